"""Decoders in Relax as embedding models run them (every token's last hidden state): Qwen3, as
Qwen3-Embedding (the sentence embedding is the last token's), and Gemma3's text model, as
EmbeddingGemma (bidirectional: mean pooling), on the parts the encoders are built from
(``layers.py``, ``modernbert.rotated``). What differs from them, Qwen3:

- causal attention: a query attends to itself and the keys before it. It is a bias by distance
  (0 for keys at or before the query, ``WINDOW_FILL`` after it), the table ModernBERT's window
  and MPNet's relative positions use, so both layouts and the packed kernel take it as they take
  theirs;
- key and value heads shared by groups of query heads (grouped-query attention): the fused
  projection computes each shared head once, and attention reads it for every query head of
  its group;
- RMSNorm before each block, and on each head's queries and keys before their rotation;
- a gated SiLU: ``down(silu(gate(x)) * up(x))``, the gate and up projections one dense layer.

Gemma3 (``config.GEMMA3``) differs from Qwen3 in: attention bidirectional, full in one layer of
a few and within a window in the others (ModernBERT's two kinds, each its own rotary base); a
norm after the attention and after the MLP as well as before (``DecoderLayer.sandwich``); a
gated tanh GELU. Its norms' ``1 + weight``, its embedding's scale and its query scale are folded
into the weights at load (``family_tensors.py``), so the layers compute Qwen3's arithmetic.

Attribute names mirror transformers' ``Qwen3Model`` and ``Gemma3TextModel`` (``layers`` and
``norm`` under ``encoder``)."""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .config import GEMMA3, BertConfig
from .layers import Embedding, TransposedLinear, activation, token_rows
from .modernbert import RotaryEncoder, rotated


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last axis, as ``Qwen3RMSNorm``."""

    def __init__(self, width: int, eps: float):
        self.weight = nn.Parameter((width,), "float32")
        self.eps = eps

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return op.rms_norm(x, self.weight, axes=-1, epsilon=self.eps)


class DecoderEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, input_ids: nn.Tensor, token_type_ids: nn.Tensor, position_ids: nn.Tensor) -> nn.Tensor:
        """As ``BertEmbeddings.forward``; the types and positions play no part here."""
        return token_rows(self.embed_tokens, input_ids)


class DecoderAttention(nn.Module):
    """The query, key and value projections as one, each head's queries and keys RMS-normed (a
    decoder's; NomicBERT's are not), rotated, attended, projected out."""

    def __init__(self, cfg: BertConfig):
        self.heads, self.head_dim, self.kv_heads = cfg.num_attention_heads, cfg.head_dim, cfg.kv_heads
        self.qkv = TransposedLinear(cfg.hidden_size, cfg.projection_width, parts=("q_proj", "k_proj", "v_proj"))
        self.q_norm = self.k_norm = None
        if cfg.head_norms:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.layer_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.layer_norm_eps)
        self.o_proj = TransposedLinear(cfg.attention_width, cfg.hidden_size)

    def forward(self, hidden: nn.Tensor, attention, rotary: tuple) -> nn.Tensor:
        cos, sin, batch = rotary
        qkv = self.qkv(hidden)
        if self.q_norm is not None:
            qkv = self._heads_normed(qkv)
        qkv = rotated(qkv, cos, sin, self.heads, self.head_dim, batch, self.kv_heads)
        return self.o_proj(attention(qkv, self.heads, self.head_dim, self.kv_heads))

    def _heads_normed(self, qkv: nn.Tensor) -> nn.Tensor:
        """``qkv`` with each query head and key head RMS-normed, the values as they are."""
        heads, shared = self.heads, self.kv_heads
        parts = op.reshape(qkv, (qkv.shape[0], heads + 2 * shared, self.head_dim))

        def part(begin: int, end: int) -> nn.Tensor:
            return nn.op.wrap_nested(relax.op.strided_slice(parts._expr, [1], [begin], [end]), "qkv_part")

        normed = op.concat([self.q_norm(part(0, heads)), self.k_norm(part(heads, heads + shared)),
                            part(heads + shared, heads + 2 * shared)], dim=1)
        return op.reshape(normed, qkv.shape)


class GatedMLP(nn.Module):
    def __init__(self, cfg: BertConfig):
        self.gate_up = TransposedLinear(cfg.hidden_size, 2 * cfg.intermediate_size, parts=("gate_proj", "up_proj"))
        self.down_proj = TransposedLinear(cfg.intermediate_size, cfg.hidden_size)
        self.hidden_act = cfg.hidden_act

    def forward(self, hidden: nn.Tensor) -> nn.Tensor:
        gate, up = op.split(self.gate_up(hidden), 2, axis=-1)
        return self.down_proj(activation(gate, self.hidden_act) * up)


class DecoderLayer(nn.Module):
    """Qwen3's: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``; ``sandwich`` (Gemma3's): each
    block's output normed too before it is added."""

    def __init__(self, cfg: BertConfig, kind: str):
        self.kind, self.sandwich = kind, cfg.model_type == GEMMA3
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.self_attn = DecoderAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = GatedMLP(cfg)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, hidden: nn.Tensor, attention, rotary: tuple) -> nn.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), attention, rotary)
        if not self.sandwich:
            hidden = hidden + attended
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class DecoderEncoder(RotaryEncoder):
    """The layers and the final norm, with the tables of ``RotaryEncoder`` (a causal mask is a
    full layer's bias)."""

    def __init__(self, cfg: BertConfig):
        self.layers = nn.ModuleList([DecoderLayer(cfg, kind) for kind in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.declare_tables(cfg)

    def forward(self, hidden: nn.Tensor, attention_of: dict, position_ids: nn.Tensor, batch=None) -> nn.Tensor:
        return self.norm(self.run_layers(hidden, attention_of, position_ids, batch))
