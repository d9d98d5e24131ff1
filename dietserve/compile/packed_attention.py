"""A packed build's attention kernels: which ones a model's layers run (one per masking, with the
layers calling it), and each built from the tuned tiles. One description serves the build and
the tuning task, so the tuner times the kernels the model serves."""

from __future__ import annotations

from ..kernels.cpu_varlen.attention import bf16_attention_fits, query_parts_for, varlen_attention
from ..kernels.cpu_varlen.tile import tile_for
from ..kernels.plan.attention_plan import AttentionPlan
from ..kernels.plan.task_file import AttentionKernel, AttentionTask
from ..model.config import FULL_ATTENTION, SLIDING_ATTENTION


def attention_kernels(config) -> tuple[AttentionKernel, AttentionKernel | None]:
    """(the full layers' kernel or None, the sliding-window layers' or None). A rotary family's
    full layers take a bias where it is causal; MPNet's every layer, by distance."""
    layers = config.layer_types or (FULL_ATTENTION,) * config.num_hidden_layers
    full_calls, windowed_calls = layers.count(FULL_ATTENTION), layers.count(SLIDING_ATTENTION)
    full = AttentionKernel(full_calls, config.biased(FULL_ATTENTION) if config.rotary else config.score_bias,
                           causal=config.causal) if full_calls else None
    windowed = AttentionKernel(windowed_calls, True, config.sliding_window, config.causal) if windowed_calls else None
    return full, windowed


def attention_task(config, max_len: int, weights: list) -> AttentionTask:
    """The tuning task of the model's attention: its kernels as served, each weighted by its layers."""
    return AttentionTask(config.num_attention_heads, config.head_dim, max_len, weights, config.kv_heads,
                         tuple(kernel for kernel in attention_kernels(config) if kernel is not None))


def attention_functions(config, precision: str, hardware, attention: AttentionPlan | None):
    """(the full layers' PrimFunc, the windowed layers' or None) from ``attention``'s tiles and
    tree, else the hardware's tile; bf16 products where every tile can run them on pairs (16-lane
    vectors), else attention stays fp32; each (head, sequence) in as many tasks as keep the
    hardware's cores busy (``query_parts_for``)."""
    tiles, tree = (attention.varlen_tiles(), attention.tree) if attention else (tile_for(hardware), None)
    named = tiles if isinstance(tiles, dict) else {"tile": tiles}
    paired = precision == "bf16" and all(bf16_attention_fits(t, config.head_dim) for t in named.values())

    def build(kernel: AttentionKernel | None):
        if kernel is None:
            return None
        return varlen_attention(config.num_attention_heads, config.head_dim, config.max_length, tiles, tree,
                                precision="bf16" if paired else "fp32", kv_heads=config.kv_heads,
                                query_parts=query_parts_for(config.num_attention_heads, hardware.cores),
                                **kernel.masking())

    full, windowed = attention_kernels(config)
    # (where every layer is windowed, as Mistral's, the model still declares a full layers'
    # kernel, which none calls: a plain one)
    return build(full or AttentionKernel(1)), build(windowed)
