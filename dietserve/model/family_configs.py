"""The rotary families' ``config.json`` in ``BertConfig``'s keys: ModernBERT's, the decoders'
(Qwen3's, Qwen2's, Mistral's, Llama's; Gemma3's as EmbeddingGemma), NomicBERT's and GTE's, each
from transformers' keys or its original checkpoints' where they differ, with the options we do
not compile refused by name. ``config.BertConfig.from_dict`` reads a config through
``ROTARY_READERS``."""

from __future__ import annotations

MODERNBERT, QWEN3, GEMMA3 = "modernbert", "qwen3", "gemma3_text"
QWEN2, MISTRAL, LLAMA = "qwen2", "mistral", "llama"
# The decoders whose layers are Qwen3's without its norms on each head's queries and keys.
PLAIN_DECODERS = (QWEN2, MISTRAL, LLAMA)
NOMIC_BERT, GTE = "nomic_bert", "gte"
GTE_ORIGINAL = "new"  # the model_type of GTE's original checkpoints (Alibaba-NLP's custom code)
# The rotary families' layer kinds (``layer_types``).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


class ModelConfigError(ValueError):
    """A checkpoint's config.json is missing, malformed, or asks for something unsupported."""


# ModernBERT's config keys -> ours, with ModernBertConfig's defaults.
_MODERNBERT_KEYS = {"hidden_activation": ("hidden_act", "gelu"), "norm_eps": ("layer_norm_eps", 1e-5),
                    "vocab_size": ("vocab_size", 50368), "intermediate_size": ("intermediate_size", 1152),
                    "num_hidden_layers": ("num_hidden_layers", 22), "max_position_embeddings": (
                        "max_position_embeddings", 8192), "pad_token_id": ("pad_token_id", 50283)}
_MODERNBERT_THETAS = {FULL_ATTENTION: ("global_rope_theta", 160_000.0),
                      SLIDING_ATTENTION: ("local_rope_theta", 10_000.0)}
# Qwen3's config keys -> ours, with Qwen3Config's defaults.
_QWEN3_KEYS = {"vocab_size": ("vocab_size", 151936), "hidden_size": ("hidden_size", 4096),
               "intermediate_size": ("intermediate_size", 22016), "num_hidden_layers": ("num_hidden_layers", 32),
               "num_attention_heads": ("num_attention_heads", 32), "hidden_act": ("hidden_act", "silu"),
               "max_position_embeddings": ("max_position_embeddings", 32768), "rms_norm_eps": ("layer_norm_eps", 1e-6),
               "head_dim": ("attention_head_dim", 128)}
# Qwen2's, Mistral's and Llama's defaults where they differ from Qwen3's (their configs' classes'),
# each head hidden_size / heads wide unless ``head_dim`` says otherwise.
_PLAIN_DECODER_DEFAULTS = {
    QWEN2: {"vocab_size": 151936, "intermediate_size": 22016, "rope_theta": 10_000.0},
    MISTRAL: {"vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8, "rope_theta": 10_000.0,
              "max_position_embeddings": 4096 * 32},
    LLAMA: {"vocab_size": 32000, "intermediate_size": 11008, "max_position_embeddings": 2048, "rope_theta": 10_000.0},
}
# MistralConfig's sliding_window where a config leaves it out (null in a config: no window).
_MISTRAL_WINDOW = 4096
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


def _decoder(raw: dict) -> dict:
    """A causal decoder's config in our keys (Qwen3's, Qwen2's, Mistral's, Llama's): every layer a
    full one, or for Mistral's ``sliding_window`` a causal window, one rotary base. Qwen2's
    attention is causal unless ``is_causal`` is false (gte-Qwen2-7B-instruct's); where the
    config names its own modeling code and not ``is_causal``, which one it runs is not known, and
    the config is refused. Qwen2's query, key and value projections have biases. Qwen's sliding
    windows, Llama's MLP biases and scaled rotary positions are refused."""
    family = raw["model_type"]
    if raw.get("use_sliding_window"):
        raise ModelConfigError(f"use_sliding_window=true is not supported for {family}")
    if raw.get("mlp_bias"):
        raise ModelConfigError(f"mlp_bias=true is not supported for {family}")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        raise ModelConfigError(f"rope_parameters={rope} (scaled rotary positions) is not supported; only rope_type "
                               "'default'")
    plain = _PLAIN_DECODER_DEFAULTS.get(family, {})
    raw = {**plain, **raw}
    ours = {key: raw.get(theirs, default) for theirs, (key, default) in _QWEN3_KEYS.items()}
    if plain:
        ours["attention_head_dim"] = _own_head_dim({"hidden_size": ours["hidden_size"],
                                                    "num_attention_heads": ours["num_attention_heads"], **raw})
    heads, layers = int(ours["num_attention_heads"]), int(ours["num_hidden_layers"])
    window = raw.get("sliding_window", _MISTRAL_WINDOW) if family == MISTRAL else None
    kind = SLIDING_ATTENTION if window else FULL_ATTENTION
    return {**raw, **ours, "type_vocab_size": 1, "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
            "layer_types": (kind,) * layers,
            "rope_thetas": ((kind, float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0)))),),
            # (transformers' window W holds the query and the W - 1 keys before it)
            "sliding_window": int(window) - 1 if window else 0, "norm_bias": False,
            "linear_bias": family == QWEN2 or bool(raw.get("attention_bias", False)),
            "bidirectional": family == QWEN2 and not _qwen2_causal(raw)}


def _qwen2_causal(raw: dict) -> bool:
    """Whether a Qwen2 checkpoint's attention is causal: ``is_causal``, else transformers'
    ``Qwen2Model``'s (causal) unless the config names modeling code of its own."""
    if "is_causal" in raw:
        return bool(raw["is_causal"])
    own = (raw.get("auto_map") or {}).get("AutoModel")
    if own:
        raise ModelConfigError(f"this qwen2 config names its own modeling code (auto_map AutoModel {own!r}) and not "
                               "is_causal: its attention may be bidirectional (gte-Qwen2-7B-instruct's) or causal; "
                               "add \"is_causal\": false or true to config.json to say which")
    return True


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


# JinaBERT's feed-forward types -> the activation on its gate (its GLU MLP's).
_JINA_GATES = {"geglu": "gelu", "reglu": "relu"}


def jina_bert(raw: dict) -> dict:
    """JinaBERT's config (jina-embeddings-v2: BERT's layers, ALiBi for positions, a gated MLP;
    ``position_embedding_type`` alibi) in our keys. Its variant with queries and keys normed
    after the projection (jina-bert-v2-qk-post-norm, jina-embeddings-v2-base-code's) is refused."""
    if "qk-post-norm" in str(raw.get("auto_map") or ""):
        raise ModelConfigError("jina-bert-v2-qk-post-norm (jina-embeddings-v2-base-code's layers) is not supported")
    gate = raw.get("feed_forward_type", "original")
    if raw.get("model_type") != "bert" or gate not in _JINA_GATES:
        raise ModelConfigError(f"position_embedding_type='alibi' is supported for JinaBERT (model_type 'bert', "
                               f"feed_forward_type one of {sorted(_JINA_GATES)}), got model_type "
                               f"{raw.get('model_type')!r}, feed_forward_type {gate!r}")
    return {**{key: value for key, value in raw.items() if key != "position_embedding_type"},
            "hidden_act": _JINA_GATES[gate], "alibi": True}


# model_type -> its reader (``raw`` -> ``raw`` in our keys)
ROTARY_READERS = {MODERNBERT: _modernbert, QWEN3: _decoder, QWEN2: _decoder, MISTRAL: _decoder, LLAMA: _decoder,
                  GEMMA3: _gemma3, NOMIC_BERT: _nomic_bert, GTE: _gte, GTE_ORIGINAL: _gte}
