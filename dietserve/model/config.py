"""Encoder hyper-parameters as read from a Hugging Face ``config.json``: BERT (and JinaBERT, with
ALiBi for positions and a gated MLP), RoBERTa's family
(RoBERTa, XLM-RoBERTa, CamemBERT: the same encoder, its positions numbered past the padding
index), DistilBERT (the same layers under other names, with no token types), MPNet (RoBERTa's
numbering, no token types, and a bias on attention scores by relative position), and the rotary
families, whose configs ``family_configs.py`` reads: ModernBERT (pre-LayerNorm layers, a gated
GELU, sliding windows in two layers of three), Qwen3, the decoder Qwen3-Embedding is (causal
attention, RMSNorm, a gated SiLU, key and value heads shared by groups of query heads), the
decoders built as Qwen3 but for its norms on each head (Qwen2, gte-Qwen2's, bidirectional or
causal, with biases on its query, key and value projections; Mistral, e5-mistral's, with a
causal sliding window; Llama), Gemma3's
text model as EmbeddingGemma runs it (Qwen3's layers, bidirectional, mostly windowed, a norm
after each block too, a gated tanh GELU), NomicBERT and GTE (BERT's post-LayerNorm layers with
rotary attention and a gated MLP)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .family_configs import (
    FULL_ATTENTION,
    GEMMA3,
    GTE,
    MODERNBERT,
    NOMIC_BERT,
    PLAIN_DECODERS,
    QWEN3,
    ROTARY_READERS,
    SLIDING_ATTENTION,
    ModelConfigError,
    jina_bert,
)

# Activation names used by real BERT-family checkpoints. "gelu" is the exact erf form;
# the tanh approximation appears under several names.
SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish")
# model_type values whose checkpoints are BERT's layers under RoBERTa's position numbering.
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
DISTILBERT, MPNET = "distilbert", "mpnet"
MODEL_TYPES = ("bert", *ROBERTA_TYPES, DISTILBERT, MPNET, MODERNBERT, QWEN3, *PLAIN_DECODERS, GEMMA3, NOMIC_BERT, GTE)
_ROTARY_TYPES = (MODERNBERT, QWEN3, *PLAIN_DECODERS, GEMMA3, NOMIC_BERT, GTE)
# MPNet's relative position buckets grow logarithmically up to this distance (transformers' default).
MPNET_MAX_DISTANCE = 128
# DistilBERT's config keys -> BERT's, with DistilBertConfig's defaults; its LayerNorm epsilon is fixed.
_DISTILBERT_KEYS = {"dim": ("hidden_size", 768), "n_layers": ("num_hidden_layers", 6),
                    "n_heads": ("num_attention_heads", 12), "hidden_dim": ("intermediate_size", 3072),
                    "activation": ("hidden_act", "gelu")}
# Fields of the families beyond BERT's (the rotary ones, JinaBERT), left out of ``to_dict`` at their defaults.
_FAMILY_FIELDS = ("layer_types", "rope_thetas", "sliding_window", "norm_bias", "linear_bias", "classifier_pooling",
                  "classifier_activation", "classifier_bias", "num_key_value_heads", "attention_head_dim",
                  "query_pre_attn_scalar", "rope_ntk_factor", "bidirectional", "alibi")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    model_type: str = "bert"
    # MPNet's: buckets of relative position whose learned bias each head adds to its scores; 0: none
    relative_attention_num_buckets: int = 0
    # ModernBERT's: each layer's kind (full or sliding-window attention), the rotary base of each
    # kind, the window's half width (a query attends to keys at most this far), whether its
    # LayerNorms and linear layers have biases
    layer_types: tuple[str, ...] = ()
    rope_thetas: tuple[tuple[str, float], ...] = ()
    sliding_window: int = 0
    norm_bias: bool = True
    linear_bias: bool = True
    # ModernBERT's classifier head: the rows it reads (cls or mean), its activation, its dense bias
    classifier_pooling: str = "cls"
    classifier_activation: str = "gelu"
    classifier_bias: bool = True
    # Qwen3's: key and value heads (0: one per query head; fewer: each shared by a group of query
    # heads), and the head width where it is not hidden_size / heads (0: it is)
    num_key_value_heads: int = 0
    attention_head_dim: int = 0
    # Gemma3's: the scores are scaled by this to the -1/2 in place of head_dim's (0: head_dim)
    query_pre_attn_scalar: int = 0
    # GTE's original checkpoints' fixed NTK scaling of the rotary frequencies (0: none;
    # ``modernbert.rotary_tables``)
    rope_ntk_factor: float = 0.0
    # A Qwen2 decoder whose attention reads every token (gte-Qwen2-7B-instruct's ``is_causal`` false)
    bidirectional: bool = False
    # JinaBERT's: positions as a bias by distance (ALiBi: -slope * |distance|, a slope per head,
    # no position table) and a gated MLP (``act(gate) * up``, the gate and up projections one dense layer)
    alibi: bool = False

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ModelConfigError(f"model_type={self.model_type!r} is not supported; dietserve compiles "
                                   f"{', '.join(MODEL_TYPES)} checkpoints")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelConfigError(
                f"hidden_act={self.hidden_act!r} is not supported; expected one of {SUPPORTED_ACTIVATIONS}"
            )
        if not self.attention_head_dim and self.hidden_size % self.num_attention_heads != 0:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or not set(self.layer_types) <= {FULL_ATTENTION, SLIDING_ATTENTION}):
            raise ModelConfigError(f"layer_types must name {FULL_ATTENTION} or {SLIDING_ATTENTION} for each of the "
                                   f"{self.num_hidden_layers} layers, got {list(self.layer_types)}")
        if self.num_key_value_heads and self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                                   f"num_key_value_heads={self.num_key_value_heads}")
        if self.classifier_pooling not in ("cls", "mean"):
            raise ModelConfigError(f"classifier_pooling={self.classifier_pooling!r} is not supported; expected "
                                   "'cls' or 'mean'")
        if self.classifier_activation not in SUPPORTED_ACTIVATIONS:
            raise ModelConfigError(f"classifier_activation={self.classifier_activation!r} is not supported; "
                                   f"expected one of {SUPPORTED_ACTIVATIONS}")
        if self.max_length <= 0:
            raise ModelConfigError(f"max_position_embeddings={self.max_position_embeddings} leaves no position "
                                   f"after the {self.position_offset} a {self.model_type} checkpoint skips")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def attention_width(self) -> int:
        """The query's width, every head counted."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key and value heads: one per query head, or fewer each shared by a group (Qwen3's)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def projection_width(self) -> int:
        """The fused query, key and value projection's width."""
        return (self.num_attention_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def position_offset(self) -> int:
        """Rows of the checkpoint's position table before the first token's: RoBERTa numbers
        positions from ``pad_token_id + 1`` (the rows below serve padding only)."""
        if self.model_type == MPNET:
            return 2  # (transformers' MPNet numbers from its fixed padding index 1, whatever the config says)
        return self.pad_token_id + 1 if self.model_type in ROBERTA_TYPES else 0

    @property
    def pooler_activation(self) -> str:
        """What a classifier's head applies to its dense layer on the first token: BERT's pooler
        and RoBERTa's head a tanh, DistilBERT's ``pre_classifier`` a ReLU."""
        return "relu" if self.model_type == DISTILBERT else "tanh"

    @property
    def score_bias(self) -> bool:
        """Whether attention adds a bias by distance to its scores: MPNet's relative positions,
        JinaBERT's ALiBi, ModernBERT's sliding window, Qwen3's causal mask."""
        return self.relative_attention_num_buckets > 0 or self.alibi or any(map(self.biased, self.layer_types))

    def biased(self, kind: str) -> bool:
        """Whether a rotary family's layers of ``kind`` mask keys by distance: a sliding window,
        or (a decoder) every key after the query."""
        return self.causal or kind == SLIDING_ATTENTION

    @property
    def rotary(self) -> bool:
        """Positions by rotating queries and keys (ModernBERT, the decoders, NomicBERT, GTE), not by
        a table of embeddings."""
        return self.model_type in _ROTARY_TYPES

    @property
    def post_norm_rotary(self) -> bool:
        """BERT's post-LayerNorm layers with rotary attention and a gated MLP (NomicBERT, GTE)."""
        return self.model_type in (NOMIC_BERT, GTE)

    @property
    def decoder_layers(self) -> bool:
        """Built of a decoder's layers (Qwen3's, Qwen2's, Mistral's, Llama's, Gemma3's): RMSNorm, a
        gated MLP, no biases but where the config says; attention causal or not."""
        return self.model_type in (QWEN3, *PLAIN_DECODERS, GEMMA3)

    @property
    def head_norms(self) -> bool:
        """Whether each head's queries and keys are RMS-normed before their rotation (Qwen3's, Gemma3's)."""
        return self.model_type in (QWEN3, GEMMA3)

    @property
    def causal(self) -> bool:
        """A decoder's attention: each token attends to itself and the tokens before it (Qwen3's,
        Mistral's, Llama's, Qwen2's unless bidirectional)."""
        return self.model_type in (QWEN3, *PLAIN_DECODERS) and not self.bidirectional

    @property
    def max_length(self) -> int:
        """The longest sequence, in tokens, the position table holds."""
        return self.max_position_embeddings - self.position_offset

    def to_dict(self) -> dict:
        """The fields, without the other families' at their defaults: an earlier build's manifest
        and cache key read the same for every other family (a hot swap compares manifests' configs)."""
        defaults = BertConfig.__dataclass_fields__
        return {name: value for name, value in asdict(self).items()
                if name not in _FAMILY_FIELDS or value != defaults[name].default}

    @classmethod
    def from_dict(cls, raw: dict) -> BertConfig:
        rotary = ROTARY_READERS.get(raw.get("model_type"))
        if rotary is not None:
            raw = rotary(raw)
        position_kind = raw.get("position_embedding_type", "absolute")
        if position_kind == "alibi":
            raw = jina_bert(raw)
        elif position_kind != "absolute":
            raise ModelConfigError(
                f"position_embedding_type={position_kind!r} is not supported (only 'absolute', and JinaBERT's 'alibi')"
            )
        if raw.get("model_type") == DISTILBERT:
            renamed = {ours: raw.get(theirs, default) for theirs, (ours, default) in _DISTILBERT_KEYS.items()}
            raw = {**raw, **renamed, "type_vocab_size": 1, "layer_norm_eps": 1e-12}
        elif raw.get("model_type") == MPNET:
            raw = {"relative_attention_num_buckets": 32, **raw, "type_vocab_size": 1}
        known = {name for name in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in raw.items() if k in known}
        if kwargs.get("pad_token_id") is None:  # transformers' default for the model type
            kwargs["pad_token_id"] = 1 if kwargs.get("model_type") in ROBERTA_TYPES else 0
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError as err:
            raise ModelConfigError(f"no config.json at {path}") from err
        except json.JSONDecodeError as err:
            raise ModelConfigError(f"{path} is not valid JSON: {err}") from err
        return cls.from_dict(raw)


# BERT-base as in DietCode's experiments; used with seeded random weights for benchmarks.
BERT_BASE = BertConfig()
