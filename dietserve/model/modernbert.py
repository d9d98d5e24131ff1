"""ModernBERT's encoder in Relax, on BERT's parts (``layers.py``): the same dense layers, attention
kernels and layouts, with what differs:

- no position table: each layer rotates its queries and keys by their positions (rotary
  embeddings), with one base for full layers and another for sliding-window ones;
- LayerNorm before each block (none before the first layer's attention), one after the last;
- a gated GELU: one linear layer to twice the intermediate width, ``gelu(first half) * second``;
- two layers in three attend only to keys within ``sliding_window`` of the query. The window is
  a bias on the scores by distance (0 inside, ``WINDOW_FILL`` outside), the table MPNet's
  relative positions already use, so both layouts add it as they add MPNet's; the windowed
  layers' packed kernel also skips the key tiles the window masks (``varlen_attention(window=)``);
- no biases: the loader gives the layers zero ones (``checkpoint.py``).

Attribute names mirror transformers' ``ModernBertModel`` (``layers`` and ``final_norm`` under
``encoder``) so checkpoint tensors map one to one.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .config import BertConfig
from .layers import Embedding, TransposedLinear, activation, take_rows, token_rows

# Outside a sliding window: far below any score, yet added to the padding mask's fill it stays
# finite in float32 (the two would overflow to -inf).
WINDOW_FILL = -1e30


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: nn.Tensor, token_type_ids: nn.Tensor, position_ids: nn.Tensor) -> nn.Tensor:
        """As ``BertEmbeddings.forward``; the types and positions play no part here."""
        return self.norm(token_rows(self.tok_embeddings, input_ids))


def rotated(qkv: nn.Tensor, cos: nn.Tensor, sin: nn.Tensor, heads: int, head_dim: int, batch=None,
            kv_heads: int | None = None) -> nn.Tensor:
    """``qkv`` (``[rows, (heads + 2 * kv_heads) * head_dim]``: the query heads, the key heads, the
    value heads; ``kv_heads`` None: as many as ``heads``) with its queries and keys rotated by
    their positions' ``cos`` and ``sin`` (``[seq or rows, head_dim]``, as transformers'
    ``rotate_half`` pairs dimension i with i + head_dim / 2); padded rows (``batch`` given) are
    ``[batch * seq]``, the positions ``[seq]`` the same in every row."""
    kv_heads = heads if kv_heads is None else kv_heads
    lead = (batch, cos.shape[0]) if batch is not None else (qkv.shape[0],)
    parts = op.reshape(qkv, (*lead, heads + 2 * kv_heads, head_dim))
    axis = len(lead)

    def sliced(tensor: nn.Tensor, axis_: int, begin: int, end: int) -> nn.Tensor:
        return nn.op.wrap_nested(relax.op.strided_slice(tensor._expr, [axis_], [begin], [end]), "rotary_part")

    query_key, value = sliced(parts, axis, 0, heads + kv_heads), sliced(parts, axis, heads + kv_heads,
                                                                         heads + 2 * kv_heads)
    half = head_dim // 2
    first, second = sliced(query_key, axis + 1, 0, half), sliced(query_key, axis + 1, half, head_dim)
    turned = op.concat([op.negative(second), first], dim=axis + 1)
    shape = (1, cos.shape[0], 1, head_dim) if batch is not None else (cos.shape[0], 1, head_dim)
    out = query_key * op.reshape(cos, shape) + turned * op.reshape(sin, shape)
    return op.reshape(op.concat([out, value], dim=axis), qkv.shape)


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.Wqkv = TransposedLinear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.Wo = TransposedLinear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, hidden: nn.Tensor, attention, rotary: tuple) -> nn.Tensor:
        cos, sin, batch = rotary
        qkv = rotated(self.Wqkv(hidden), cos, sin, self.heads, self.head_dim, batch)
        return self.Wo(attention(qkv, self.heads, self.head_dim))


class ModernBertMLP(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.Wi = TransposedLinear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.Wo = TransposedLinear(cfg.intermediate_size, cfg.hidden_size)
        self.hidden_act = cfg.hidden_act

    def forward(self, hidden: nn.Tensor) -> nn.Tensor:
        gated, gate = op.split(self.Wi(hidden), 2, axis=-1)
        return self.Wo(activation(gated, self.hidden_act) * gate)


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, index: int):
        # (transformers' first layer has no norm before attention: the embeddings' norm serves)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if index else None
        self.attn = ModernBertAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = ModernBertMLP(cfg)
        self.kind = cfg.layer_types[index]

    def forward(self, hidden: nn.Tensor, attention, rotary: tuple) -> nn.Tensor:
        normed = self.attn_norm(hidden) if self.attn_norm is not None else hidden
        hidden = hidden + self.attn(normed, attention, rotary)
        return hidden + self.mlp(self.mlp_norm(hidden))


class RotaryEncoder(nn.Module):
    """What a rotary family's encoder holds beside its layers: per layer kind
    (``config.FULL_ATTENTION``, ``SLIDING_ATTENTION``) rotary tables ``[max_length, head_dim]``
    and, where the attention takes a bias on scores (a window, a causal mask), its table by
    distance (``BertEncoder.relative_bias``'s layout), all computed at load
    (``family_tensors.rotary_family_tables``)."""

    def declare_tables(self, cfg: BertConfig) -> None:
        self.kinds = sorted(set(cfg.layer_types))
        for kind in self.kinds:
            setattr(self, f"{kind}_cos", nn.Parameter((cfg.max_length, cfg.head_dim), "float32"))
            setattr(self, f"{kind}_sin", nn.Parameter((cfg.max_length, cfg.head_dim), "float32"))
            if cfg.biased(kind):
                setattr(self, f"{kind}_bias", nn.Parameter((cfg.num_attention_heads, 2 * cfg.max_length - 1),
                                                           "float32"))

    def bias(self, kind: str) -> nn.Tensor | None:
        return getattr(self, f"{kind}_bias", None)

    def run_layers(self, hidden: nn.Tensor, attention_of: dict, position_ids: nn.Tensor, batch) -> nn.Tensor:
        """``attention_of``: each kind's attention (``PaddedAttention``, ``PackedAttention``);
        ``position_ids``: ``[seq]`` (padded, ``batch`` rows) or ``[T]`` (packed)."""
        rotary = {}
        for kind in self.kinds:
            tables = (getattr(self, f"{kind}_cos"), getattr(self, f"{kind}_sin"))
            rotary[kind] = (*(take_rows(table, position_ids) for table in tables), batch)
        for layer in self.layers:
            hidden = layer(hidden, attention_of[layer.kind], rotary[layer.kind])
        return hidden


class ModernBertEncoder(RotaryEncoder):
    """The layers and the final norm, with the tables of ``RotaryEncoder``."""

    def __init__(self, cfg: BertConfig):
        self.layers = nn.ModuleList([ModernBertLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.declare_tables(cfg)

    def forward(self, hidden: nn.Tensor, attention_of: dict, position_ids: nn.Tensor, batch=None) -> nn.Tensor:
        return self.final_norm(self.run_layers(hidden, attention_of, position_ids, batch))


class ModernBertPredictionHead(nn.Module):
    """A sequence classifier's head before its output layer: the first token's row or the mean of
    the attended ones (``classifier_pooling``), then a dense layer, activation and LayerNorm."""

    def __init__(self, cfg: BertConfig):
        self.dense = TransposedLinear(cfg.hidden_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.pooling, self.act = cfg.classifier_pooling, cfg.classifier_activation

    def forward(self, hidden: nn.Tensor, mask: nn.Tensor) -> nn.Tensor:
        """``hidden`` ``[batch, seq, width]``, ``mask`` ``[batch, seq]`` (float)."""
        batch, _, width = hidden.shape
        if self.pooling == "mean":
            summed = op.sum(hidden * op.reshape(mask, (*mask.shape, 1)), axis=1)
            pooled = summed / op.sum(mask, axis=1, keepdims=True)
        else:
            first = nn.op.wrap_nested(relax.op.strided_slice(hidden._expr, [1], [0], [1]), "cls_row")
            pooled = op.reshape(first, (batch, width))
        return self.norm(activation(self.dense(pooled), self.act))


def rotary_tables(theta: float, head_dim: int, length: int, ntk_factor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[length, head_dim]`` of positions 0.. by transformers' default rotary
    embedding, in float32 as it computes them. ``ntk_factor`` f (GTE's original checkpoints'
    fixed NTK scaling, gte-*-en-v1.5's): the base ``theta * f`` and every frequency divided by
    ``f ** (2 / head_dim)``, as their code computes at every length."""
    # (the power in float64, rounded to float32, then divided in float32: bit for bit torch's
    # inverse frequencies here, which a far position's angle multiplies by thousands)
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    base = theta * ntk_factor if ntk_factor else theta
    inverse = np.float32(1.0) / (base ** exponents.astype(np.float64)).astype(np.float32)
    if ntk_factor:
        inverse = inverse / np.float32(ntk_factor ** (2 / head_dim))
    angles = np.arange(length, dtype=np.float32)[:, None] * inverse[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def window_bias(heads: int, max_length: int, half_width: int | None, causal: bool = False) -> np.ndarray:
    """``[heads, 2 * max_length - 1]`` by key-minus-query distance: 0 within ``half_width`` (None:
    everywhere) and, ``causal``, not after the query; ``WINDOW_FILL`` elsewhere."""
    distance = np.arange(1 - max_length, max_length)
    inside = np.abs(distance) <= (half_width if half_width is not None else max_length)
    row = np.where(inside & ((distance <= 0) | (not causal)), 0.0, WINDOW_FILL)
    return np.ascontiguousarray(np.broadcast_to(row.astype(np.float32), (heads, row.size)))
