"""Encoder hyper-parameters as read from a Hugging Face ``config.json``: BERT, RoBERTa's family
(RoBERTa, XLM-RoBERTa, CamemBERT: the same encoder, its positions numbered past the padding
index), DistilBERT (the same layers under other names, with no token types), MPNet (RoBERTa's
numbering, no token types, and a bias on attention scores by relative position), ModernBERT
(no position table: rotary positions; pre-LayerNorm layers, a gated GELU, no biases, and attention
within a window of nearby tokens in two layers of three), Qwen3, the decoder Qwen3-Embedding
is (rotary positions, causal attention, RMSNorm, a gated SiLU, key and value heads shared by
groups of query heads), Gemma3's text model as EmbeddingGemma runs it (Qwen3's layers with
bidirectional attention, sliding windows in most layers, a norm after each block too, and a
gated tanh GELU), NomicBERT (nomic-embed-text: BERT's post-LayerNorm layers with rotary
positions, a gated SiLU and no biases; its config in transformers' keys or in the original
GPT-2-style ones) and GTE (the same layers with biases and a gated GELU; ``gte``, or the original
checkpoints' ``new``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

# Activation names used by real BERT-family checkpoints. "gelu" is the exact erf form;
# the tanh approximation appears under several names.
SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish")
# model_type values whose checkpoints are BERT's layers under RoBERTa's position numbering.
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
DISTILBERT, MPNET, MODERNBERT, QWEN3, GEMMA3 = "distilbert", "mpnet", "modernbert", "qwen3", "gemma3_text"
NOMIC_BERT, GTE = "nomic_bert", "gte"
GTE_ORIGINAL = "new"  # the model_type of GTE's original checkpoints (Alibaba-NLP's custom code)
MODEL_TYPES = ("bert", *ROBERTA_TYPES, DISTILBERT, MPNET, MODERNBERT, QWEN3, GEMMA3, NOMIC_BERT, GTE)
# MPNet's relative position buckets grow logarithmically up to this distance (transformers' default).
MPNET_MAX_DISTANCE = 128
# DistilBERT's config keys -> BERT's, with DistilBertConfig's defaults; its LayerNorm epsilon is fixed.
_DISTILBERT_KEYS = {"dim": ("hidden_size", 768), "n_layers": ("num_hidden_layers", 6),
                    "n_heads": ("num_attention_heads", 12), "hidden_dim": ("intermediate_size", 3072),
                    "activation": ("hidden_act", "gelu")}
# ModernBERT's config keys -> ours, with ModernBertConfig's defaults.
_MODERNBERT_KEYS = {"hidden_activation": ("hidden_act", "gelu"), "norm_eps": ("layer_norm_eps", 1e-5),
                    "vocab_size": ("vocab_size", 50368), "intermediate_size": ("intermediate_size", 1152),
                    "num_hidden_layers": ("num_hidden_layers", 22), "max_position_embeddings": (
                        "max_position_embeddings", 8192), "pad_token_id": ("pad_token_id", 50283)}
# ModernBERT's layer kinds (``layer_types``) and rotary bases by kind (its defaults).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# Fields of the rotary families, left out of ``to_dict`` at their defaults.
_ROTARY_FIELDS = ("layer_types", "rope_thetas", "sliding_window", "norm_bias", "linear_bias", "classifier_pooling",
                  "classifier_activation", "classifier_bias", "num_key_value_heads", "attention_head_dim",
                  "query_pre_attn_scalar", "rope_ntk_factor")
_MODERNBERT_THETAS = {FULL_ATTENTION: ("global_rope_theta", 160_000.0),
                      SLIDING_ATTENTION: ("local_rope_theta", 10_000.0)}
# Qwen3's config keys -> ours, with Qwen3Config's defaults.
_QWEN3_KEYS = {"vocab_size": ("vocab_size", 151936), "hidden_size": ("hidden_size", 4096),
               "intermediate_size": ("intermediate_size", 22016), "num_hidden_layers": ("num_hidden_layers", 32),
               "num_attention_heads": ("num_attention_heads", 32), "hidden_act": ("hidden_act", "silu"),
               "max_position_embeddings": ("max_position_embeddings", 32768), "rms_norm_eps": ("layer_norm_eps", 1e-6),
               "head_dim": ("attention_head_dim", 128)}
# Gemma3's config keys -> ours, with Gemma3TextConfig's defaults.
_GEMMA3_KEYS = {**_QWEN3_KEYS, "vocab_size": ("vocab_size", 262_208), "hidden_size": ("hidden_size", 2304),
                "intermediate_size": ("intermediate_size", 9216), "num_hidden_layers": ("num_hidden_layers", 26),
                "num_attention_heads": ("num_attention_heads", 8), "max_position_embeddings": (
                    "max_position_embeddings", 131_072), "head_dim": ("attention_head_dim", 256),
                "hidden_activation": ("hidden_act", "gelu_pytorch_tanh")}
_GEMMA3_THETAS = {FULL_ATTENTION: ("rope_theta", 1_000_000.0), SLIDING_ATTENTION: ("rope_local_base_freq", 10_000.0)}
# NomicBERT's original (GPT-2-style) config keys -> transformers' NomicBertConfig keys, with its defaults.
_NOMIC_KEYS = {"n_embd": ("hidden_size", 768), "n_layer": ("num_hidden_layers", 12),
               "n_head": ("num_attention_heads", 12), "n_inner": ("intermediate_size", 3072),
               "layer_norm_epsilon": ("layer_norm_eps", 1e-12), "vocab_size": ("vocab_size", 30528),
               "type_vocab_size": ("type_vocab_size", 2)}
# The original config's options that change the arithmetic, with the only values we compile.
_NOMIC_FIXED = {"prenorm": False, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
                "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "moe_every_n_layers": 0,
                "activation_function": "swiglu"}
# GTE's original config's options that change the arithmetic, with the only values we compile.
_GTE_FIXED = {"position_embedding_type": "rope", "layer_norm_type": "layer_norm", "logn_attention_scale": False,
              "logn_attention_clip1": False, "pack_qkv": True}


class ModelConfigError(ValueError):
    """A checkpoint's config.json is missing, malformed, or asks for something unsupported."""


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
        ModernBERT's sliding window, Qwen3's causal mask."""
        return self.relative_attention_num_buckets > 0 or any(map(self.biased, self.layer_types))

    def biased(self, kind: str) -> bool:
        """Whether a rotary family's layers of ``kind`` mask keys by distance: a sliding window,
        or (a decoder) every key after the query."""
        return self.causal or kind == SLIDING_ATTENTION

    @property
    def rotary(self) -> bool:
        """Positions by rotating queries and keys (ModernBERT, Qwen3, Gemma3, NomicBERT, GTE), not by
        a table of embeddings."""
        return self.model_type in (MODERNBERT, QWEN3, GEMMA3, NOMIC_BERT, GTE)

    @property
    def post_norm_rotary(self) -> bool:
        """BERT's post-LayerNorm layers with rotary attention and a gated MLP (NomicBERT, GTE)."""
        return self.model_type in (NOMIC_BERT, GTE)

    @property
    def decoder_layers(self) -> bool:
        """Built of a decoder's layers (Qwen3's, Gemma3's): RMSNorm, each head's queries and keys
        normed, a gated MLP, no biases but where the config says; attention causal or not."""
        return self.model_type in (QWEN3, GEMMA3)

    @property
    def causal(self) -> bool:
        """A decoder's attention: each token attends to itself and the tokens before it (Qwen3)."""
        return self.model_type == QWEN3

    @property
    def max_length(self) -> int:
        """The longest sequence, in tokens, the position table holds."""
        return self.max_position_embeddings - self.position_offset

    def to_dict(self) -> dict:
        """The fields, without the rotary families' at their defaults: an earlier build's manifest
        and cache key read the same for every other family (a hot swap compares manifests' configs)."""
        defaults = BertConfig.__dataclass_fields__
        return {name: value for name, value in asdict(self).items()
                if name not in _ROTARY_FIELDS or value != defaults[name].default}

    @classmethod
    def from_dict(cls, raw: dict) -> BertConfig:
        if raw.get("model_type") in (GTE, GTE_ORIGINAL):
            raw = _gte(raw)
        position_kind = raw.get("position_embedding_type", "absolute")
        if position_kind != "absolute":
            raise ModelConfigError(
                f"position_embedding_type={position_kind!r} is not supported (only 'absolute')"
            )
        if raw.get("model_type") == DISTILBERT:
            renamed = {ours: raw.get(theirs, default) for theirs, (ours, default) in _DISTILBERT_KEYS.items()}
            raw = {**raw, **renamed, "type_vocab_size": 1, "layer_norm_eps": 1e-12}
        elif raw.get("model_type") == MPNET:
            raw = {"relative_attention_num_buckets": 32, **raw, "type_vocab_size": 1}
        elif raw.get("model_type") == MODERNBERT:
            raw = _modernbert(raw)
        elif raw.get("model_type") == QWEN3:
            raw = _qwen3(raw)
        elif raw.get("model_type") == GEMMA3:
            raw = _gemma3(raw)
        elif raw.get("model_type") == NOMIC_BERT:
            raw = _nomic_bert(raw)
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


def _modernbert(raw: dict) -> dict:
    """ModernBERT's config in our keys: its layer kinds (``layer_types``, or one full layer in
    ``global_attn_every_n_layers``), rotary bases (``rope_parameters``, or the older
    ``global_rope_theta`` and ``local_rope_theta``), window and biases."""
    ours = {key: raw.get(theirs, default) for theirs, (key, default) in _MODERNBERT_KEYS.items()}
    layers = int(ours["num_hidden_layers"])
    every = int(raw.get("global_attn_every_n_layers") or 3)
    kinds = raw.get("layer_types") or [SLIDING_ATTENTION if i % every else FULL_ATTENTION for i in range(layers)]
    thetas = _rope_thetas(raw, _MODERNBERT_THETAS)
    if raw.get("attention_bias", False) != raw.get("mlp_bias", False):
        raise ModelConfigError(f"attention_bias={raw.get('attention_bias')} with mlp_bias={raw.get('mlp_bias')} "
                               "is not supported (both or neither)")
    return {**raw, **ours, "type_vocab_size": 1, "layer_types": tuple(kinds), "rope_thetas": tuple(thetas),
            "sliding_window": int(raw.get("local_attention", 128)) // 2,
            "norm_bias": bool(raw.get("norm_bias", False)), "linear_bias": bool(raw.get("attention_bias", False)),
            "classifier_pooling": raw.get("classifier_pooling", "cls"),
            "classifier_activation": raw.get("classifier_activation", "gelu"),
            "classifier_bias": bool(raw.get("classifier_bias", False))}


def _rope_thetas(raw: dict, older_keys: dict) -> list[tuple[str, float]]:
    """(kind, rotary base) per layer kind: ``rope_parameters[kind]``, or the older config's key
    for the kind (``older_keys``: kind -> (key, default)). Scaled rotary positions are refused."""
    thetas = []
    for kind, (old_key, default) in older_keys.items():
        rope = (raw.get("rope_parameters") or {}).get(kind) or {}
        if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
            raise ModelConfigError(f"rope_parameters[{kind!r}]={rope} (scaled rotary positions) is not supported; "
                                   "only rope_type 'default'")
        thetas.append((kind, float(rope.get("rope_theta", raw.get(old_key, default)))))
    return thetas


def _qwen3(raw: dict) -> dict:
    """Qwen3's config in our keys: every layer a full (causal) one, one rotary base. Sliding
    windows and scaled rotary positions are refused."""
    if raw.get("use_sliding_window"):
        raise ModelConfigError("use_sliding_window=true is not supported for qwen3")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        raise ModelConfigError(f"rope_parameters={rope} (scaled rotary positions) is not supported; only rope_type "
                               "'default'")
    ours = {key: raw.get(theirs, default) for theirs, (key, default) in _QWEN3_KEYS.items()}
    heads = int(ours["num_attention_heads"])
    return {**raw, **ours, "type_vocab_size": 1, "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
            "layer_types": (FULL_ATTENTION,) * int(ours["num_hidden_layers"]),
            "rope_thetas": ((FULL_ATTENTION, float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0)))),),
            "norm_bias": False, "linear_bias": bool(raw.get("attention_bias", False))}


def _gemma3(raw: dict) -> dict:
    """Gemma3's text model in our keys, as an embedder: its attention bidirectional
    (``use_bidirectional_attention``, EmbeddingGemma's), every layer full or sliding-window
    (``layer_types``, or one full layer in ``sliding_window_pattern``), a rotary base per kind. A
    causal Gemma3 (a generator), logit soft-capping and scaled rotary positions are refused."""
    if not raw.get("use_bidirectional_attention"):
        raise ModelConfigError("a gemma3_text checkpoint compiles as an embedder with bidirectional attention "
                               "(EmbeddingGemma's use_bidirectional_attention=true); this one is causal")
    if raw.get("attn_logit_softcapping") is not None:
        raise ModelConfigError(f"attn_logit_softcapping={raw['attn_logit_softcapping']} is not supported")
    ours = {key: raw.get(theirs, default) for theirs, (key, default) in _GEMMA3_KEYS.items()}
    layers, every = int(ours["num_hidden_layers"]), int(raw.get("sliding_window_pattern") or 6)
    kinds = raw.get("layer_types") or [FULL_ATTENTION if (i + 1) % every == 0 else SLIDING_ATTENTION
                                       for i in range(layers)]
    thetas = _rope_thetas(raw, _GEMMA3_THETAS)
    heads = int(ours["num_attention_heads"])
    # (transformers' Gemma3TextConfig reads a bidirectional model's sliding_window W as keys less
    # than W // 2 + 1 away: our half width is W // 2)
    return {**raw, **ours, "type_vocab_size": 1, "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
            "layer_types": tuple(kinds), "rope_thetas": tuple(thetas),
            "sliding_window": int(raw.get("sliding_window") or 4096) // 2, "norm_bias": False,
            "linear_bias": bool(raw.get("attention_bias", False)),
            "query_pre_attn_scalar": int(raw.get("query_pre_attn_scalar") or 256)}


def _nomic_bert(raw: dict) -> dict:
    """NomicBERT's config in our keys, from transformers' keys (``hidden_size``, ``rope_parameters``)
    or the original ones (``n_embd``, ``rotary_emb_base``, ...; nomic-embed-text's on the Hub). Of
    the original options only what nomic-embed-text-v1 and v1.5 set compiles; the rest is refused
    by name. With ``rotary_scaling_factor`` the rotation past ``max_trained_positions`` depends on
    the batch's longest text (dynamic NTK): the positions end there."""
    original = "n_embd" in raw
    if original:
        for key, wanted in _NOMIC_FIXED.items():
            if raw.get(key) not in (None, wanted):
                raise ModelConfigError(f"{key}={raw[key]!r} is not supported for nomic_bert (only {wanted!r})")
        raw = {**raw, **{ours: raw.get(theirs, default) for theirs, (ours, default) in _NOMIC_KEYS.items()},
               "hidden_act": "silu", "rope_parameters": {"rope_type": "default",
                                                         "rope_theta": raw.get("rotary_emb_base", 1000.0)}}
        longest = raw.get("max_trained_positions", 2048) if raw.get("rotary_scaling_factor") else raw.get(
            "n_positions", 2048)
    else:
        longest = raw.get("max_position_embeddings", 2048)
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        raise ModelConfigError(f"rope_parameters={rope} (scaled rotary positions) is not supported; only rope_type "
                               "'default'")
    return {"vocab_size": 30528, "type_vocab_size": 2, "hidden_act": "silu", "pad_token_id": 0, **raw,
            "max_position_embeddings": int(longest), "layer_types": (FULL_ATTENTION,) * int(
                raw.get("num_hidden_layers", 12)),
            "rope_thetas": ((FULL_ATTENTION, float(rope.get("rope_theta", raw.get("rope_theta", 1000.0)))),),
            "attention_head_dim": _own_head_dim(raw), "linear_bias": False}


def _gte(raw: dict) -> dict:
    """GTE's config in our keys, from transformers' (``gte``, ``rope_parameters``) or the original
    checkpoints' (``new``, or ``gte``: BERT's keys with ``rope_theta`` and options of its own, of which only
    what the released models set compiles; ``rope_scaling`` of type ``ntk``, gte-*-en-v1.5's
    fixed NTK scaling, is ``rope_ntk_factor``). No token types (``type_vocab_size`` 0,
    gte-base-en-v1.5's) read as one type whose embedding is zero."""
    for key, wanted in _GTE_FIXED.items():  # (Snowflake's arctic-embed-m-v2.0 has them under model_type gte)
        if raw.get(key, wanted) != wanted:
            raise ModelConfigError(f"{key}={raw[key]!r} is not supported for GTE (only {wanted!r})")
    scaling = raw.get("rope_scaling") or {}
    if scaling and (scaling.get("type") != "ntk" or scaling.get("mixed_b") is not None):
        raise ModelConfigError(f"rope_scaling={scaling} is not supported for GTE (only type 'ntk', without mixed_b)")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ModelConfigError(f"rope_parameters={rope} (scaled rotary positions) is not supported; only rope_type "
                               "'default'")
    raw = {"vocab_size": 250048, "hidden_act": "gelu", "max_position_embeddings": 8192, "pad_token_id": 1,
           **{key: value for key, value in raw.items() if key != "position_embedding_type"}, "model_type": GTE}
    return {**raw, "type_vocab_size": max(1, int(raw.get("type_vocab_size", 1))),
            "layer_types": (FULL_ATTENTION,) * int(raw.get("num_hidden_layers", 12)),
            "rope_thetas": ((FULL_ATTENTION, float(rope.get("rope_theta", raw.get("rope_theta", 160_000.0)))),),
            "rope_ntk_factor": float(scaling.get("factor", 0.0)), "attention_head_dim": _own_head_dim(raw)}


def _own_head_dim(raw: dict) -> int:
    """``head_dim`` where it is not hidden_size / heads (0: it is)."""
    width, heads = int(raw.get("hidden_size", 768)), int(raw.get("num_attention_heads", 12))
    own = int(raw.get("head_dim") or 0)
    return own if own and own * heads != width else 0


# BERT-base as in DietCode's experiments; used with seeded random weights for benchmarks.
BERT_BASE = BertConfig()
