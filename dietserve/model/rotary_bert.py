"""BERT's post-LayerNorm encoder with rotary positions, in Relax: NomicBERT (nomic-embed-text) and
GTE (gte-multilingual-base, gte-*-en-v1.5, Snowflake's arctic-embed-m-v2.0), transformers'
``NomicBertModel`` and ``GteModel``, both the layout of its ``JinaEmbeddingsV3Model``. On the
parts of the others: BERT's embeddings without the position table (``bert.BertEmbeddings``), and
BERT's layer whose attention rotates queries and keys by position (``decoders.DecoderAttention``
without per-head norms: one rotary base, every layer full attention) and whose MLP is gated
(``decoders.GatedMLP``: NomicBERT's SiLU, GTE's GELU). NomicBERT's linear layers have no biases;
GTE's all have but the gate's and up projection's. No norm follows the last layer: its own ends it.

Attribute names mirror transformers' modules (``layers`` under ``encoder``); the names both
families' checkpoints are saved under (``attn.Wqkv``, ``mlp.fc11``, ``attention.qkv_proj``, ...:
what transformers saves too) are mapped to them at load (``family_tensors.py``).
"""

from __future__ import annotations

from tvm.relax.frontend import nn

from .config import FULL_ATTENTION, BertConfig
from .decoders import DecoderAttention, GatedMLP
from .modernbert import RotaryEncoder


class RotaryBertLayer(nn.Module):
    """``h = norm(h + attn(h))``, then ``norm(h + mlp(h))``, as BERT's layer."""

    def __init__(self, cfg: BertConfig):
        self.kind = FULL_ATTENTION
        self.self_attn = DecoderAttention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = GatedMLP(cfg)
        self.post_mlp_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, hidden: nn.Tensor, attention, rotary: tuple) -> nn.Tensor:
        hidden = self.post_attention_layernorm(hidden + self.self_attn(hidden, attention, rotary))
        return self.post_mlp_layernorm(hidden + self.mlp(hidden))


class RotaryBertEncoder(RotaryEncoder):
    """The layers, with the rotary tables of ``RotaryEncoder``."""

    def __init__(self, cfg: BertConfig):
        self.layers = nn.ModuleList([RotaryBertLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.declare_tables(cfg)

    def forward(self, hidden: nn.Tensor, attention_of: dict, position_ids: nn.Tensor, batch=None) -> nn.Tensor:
        return self.run_layers(hidden, attention_of, position_ids, batch)
