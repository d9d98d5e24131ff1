"""Each family's checkpoint tensors under BERT's names and in BERT's numbering, and the tables
the encoders compute at load rather than read (MPNet's bias by distance, the rotary families'
cos, sin and masks): what ``checkpoint.load_parameters`` reads a family's weights through."""

from __future__ import annotations

import math

import numpy as np

from .config import (
    DISTILBERT,
    GEMMA3,
    GTE,
    MODERNBERT,
    MPNET,
    MPNET_MAX_DISTANCE,
    ROBERTA_TYPES,
    SLIDING_ATTENTION,
    BertConfig,
)
from .family_configs import QWEN2
from .modernbert import rotary_tables, window_bias

# Prefixes under which task heads (BertForMaskedLM, XLMRobertaForSequenceClassification, ...) nest the encoder.
_ENCODER_PREFIXES = ("bert.", "roberta.", "distilbert.", "mpnet.", "model.", "nomic_bert.", "gte.", "new.")
# Pre-2019 checkpoints name LayerNorm parameters gamma/beta.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}
# Another family's tensor names (prefix stripped) -> BERT's. RoBERTa's classification head is
# BERT's pooler and classifier under other names (a dense layer and tanh on the first token,
# then the output projection); DistilBERT names each layer its own way.
_ROBERTA_NAMES = (("classifier.dense.", "pooler.dense."), ("classifier.out_proj.", "classifier."))
_DISTILBERT_NAMES = (
    ("transformer.layer.", "encoder.layer."), (".attention.q_lin.", ".attention.self.query."),
    (".attention.k_lin.", ".attention.self.key."), (".attention.v_lin.", ".attention.self.value."),
    (".attention.out_lin.", ".attention.output.dense."), (".sa_layer_norm.", ".attention.output.LayerNorm."),
    (".ffn.lin1.", ".intermediate.dense."), (".ffn.lin2.", ".output.dense."),
    (".output_layer_norm.", ".output.LayerNorm."), ("pre_classifier.", "pooler.dense."),
)
_MPNET_NAMES = (
    (".attention.attn.q.", ".attention.self.query."), (".attention.attn.k.", ".attention.self.key."),
    (".attention.attn.v.", ".attention.self.value."), (".attention.attn.o.", ".attention.output.dense."),
    (".attention.LayerNorm.", ".attention.output.LayerNorm."), *_ROBERTA_NAMES,
)
_MODERNBERT_NAMES = (("layers.", "encoder.layers."), ("final_norm.", "encoder.final_norm."))
# NomicBERT's and GTE's saved names (their original checkpoints', and what transformers saves) ->
# our module names, as transformers' conversion reads them: NomicBERT's fc11 is the up
# projection and fc12 the gate; the fused projections are split below.
_ROTARY_BERT_NAMES = ((".attn.out_proj.", ".self_attn.o_proj."), (".mlp.fc11.", ".mlp.up_proj."),
                      (".mlp.fc12.", ".mlp.gate_proj."), (".mlp.fc2.", ".mlp.down_proj."),
                      (".norm1.", ".post_attention_layernorm."), (".norm2.", ".post_mlp_layernorm."),
                      ("emb_ln.", "embeddings.LayerNorm."), ("encoder.layer.", "encoder.layers."),
                      (".attention.o_proj.", ".self_attn.o_proj."), (".attn_ln.", ".post_attention_layernorm."),
                      (".mlp_ln.", ".post_mlp_layernorm."))
# A fused projection -> its parts, in the order they are stacked along the output axis.
_ROTARY_BERT_FUSED = {".attn.Wqkv.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
                      ".attention.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
                      ".mlp.up_gate_proj.": (".mlp.up_proj.", ".mlp.gate_proj.")}
# A masked-language-model head's tensors (BERT's, RoBERTa's and MPNet's, DistilBERT's) -> our
# sparse encoder's (``heads.SpladeHead``); a decoder left out is the word embeddings (tied).
_MLM_HEAD_NAMES = (
    ("cls.predictions.transform.", "splade.transform."), ("cls.predictions.decoder.", "splade.decoder."),
    ("cls.predictions.bias", "splade.decoder.bias"), ("lm_head.dense.", "splade.transform.dense."),
    ("lm_head.layer_norm.", "splade.transform.LayerNorm."), ("lm_head.decoder.weight", "splade.decoder.weight"),
    ("lm_head.bias", "splade.decoder.bias"), ("vocab_transform.", "splade.transform.dense."),
    ("vocab_layer_norm.", "splade.transform.LayerNorm."), ("vocab_projector.", "splade.decoder."),
)
# JinaBERT's gated MLP under BERT's names (``bert.BertIntermediate``'s gated form).
_JINA_NAMES = ((".mlp.gated_layers.", ".intermediate.dense."), (".mlp.wo.", ".output.dense."),
               (".mlp.layernorm.", ".output.LayerNorm."))
_WORDS = "embeddings.word_embeddings.weight"
_POSITIONS = "embeddings.position_embeddings.weight"
_TOKEN_TYPES = "embeddings.token_type_embeddings.weight"
_BUCKET_BIAS, _RELATIVE_BIAS = "encoder.relative_attention_bias.weight", "encoder.relative_bias"


def canonical_name(name: str) -> str:
    for prefix in _ENCODER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for old, new in _LEGACY_SUFFIXES.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
    return name


def as_bert(config: BertConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Another family's tensors under BERT's names and in BERT's numbering: RoBERTa's and MPNet's
    position tables without the rows before the first token's, DistilBERT's and MPNet's with one
    token type, all zero, and MPNet's bias by relative position bucket spread over every distance."""
    if config.rotary:
        tensors.update(rotary_family_tables(config))
    if config.decoder_layers:
        tensors = _decoder_tensors(config, tensors)
    if config.post_norm_rotary:
        tensors = _rotary_bert_tensors(tensors)
    renames = {DISTILBERT: _DISTILBERT_NAMES, MPNET: _MPNET_NAMES, MODERNBERT: _MODERNBERT_NAMES}.get(
        config.model_type, _ROBERTA_NAMES if config.model_type in ROBERTA_TYPES else ())
    renames = _JINA_NAMES if config.alibi else renames
    if config.model_type in (DISTILBERT, MPNET, GTE):  # (GTE: where type_vocab_size is 0)
        tensors.setdefault(_TOKEN_TYPES, np.zeros((1, config.hidden_size), np.float32))
    if config.alibi:
        tensors[_RELATIVE_BIAS] = alibi_bias(config.num_attention_heads, config.max_length)
    if config.relative_attention_num_buckets and _BUCKET_BIAS in tensors:
        distances = np.arange(1 - config.max_length, config.max_length)
        buckets = relative_position_buckets(distances, config.relative_attention_num_buckets)
        tensors[_RELATIVE_BIAS] = np.ascontiguousarray(tensors.pop(_BUCKET_BIAS)[buckets].T)
    for theirs, ours in renames:
        tensors = {name.replace(theirs, ours, 1): tensor for name, tensor in tensors.items()}
    tensors = {_mlm_head_name(name): tensor for name, tensor in tensors.items()}
    if _POSITIONS in tensors:  # (the rows of the positions it serves: past RoBERTa's offset, up to a cap)
        tensors[_POSITIONS] = tensors[_POSITIONS][config.position_offset:config.position_offset + config.max_length]
    return tensors


def splade_decoder(tensors: dict[str, np.ndarray], columns: int) -> dict[str, np.ndarray]:
    """A sparse encoder's decoder (``splade.decoder.weight`` ``[vocab, hidden]``, the word
    embeddings where the checkpoint ties it to them, and its bias) with zeros up to ``columns``
    outputs (``SpladeOptions.decoder_columns``); what the checkpoint lacks is left out."""
    parts = {"splade.decoder.weight": tensors.get("splade.decoder.weight", tensors.get(_WORDS)),
             "splade.decoder.bias": tensors.get("splade.decoder.bias")}
    return {name: np.concatenate([part, np.zeros((columns - len(part), *part.shape[1:]), part.dtype)])
            for name, part in parts.items() if part is not None}


def _mlm_head_name(name: str) -> str:
    for theirs, ours in _MLM_HEAD_NAMES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def rotary_family_tables(config: BertConfig) -> dict[str, np.ndarray]:
    """A rotary family's encoder tables by layer kind (``ModernBertEncoder``, ``Qwen3Encoder``):
    rotary cos and sin, and, where attention masks keys by distance, the mask as a bias (a
    sliding window, or the keys after the query)."""
    tables = {}
    for kind, theta in config.rope_thetas:
        if kind in config.layer_types:
            cos, sin = rotary_tables(theta, config.head_dim, config.max_length, config.rope_ntk_factor)
            tables.update({f"encoder.{kind}_cos": cos, f"encoder.{kind}_sin": sin})
            if config.biased(kind):
                half_width = config.sliding_window if kind == SLIDING_ATTENTION else None
                tables[f"encoder.{kind}_bias"] = window_bias(config.num_attention_heads, config.max_length, half_width,
                                                             config.causal)
    return tables


def _decoder_tensors(config: BertConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Qwen3's and Gemma3's tensors under our module names (``decoders.py``); Gemma3's with what
    its modules compute folded in, in float32 as transformers computes it: each norm scales by
    ``1 + weight``, the embedding rows by sqrt(hidden), the scores by ``query_pre_attn_scalar``
    to the -1/2 where ours divide by sqrt(head_dim) (on the query norm's weight: the rotation
    after it is linear)."""
    def ours(name: str) -> str:
        if name.startswith(("layers.", "norm.")):
            return "encoder." + name
        return "embeddings." + name if name.startswith("embed_tokens.") else name

    if config.model_type == GEMMA3:
        tensors = {name: np.float32(1.0) + tensor if name.endswith("norm.weight") else tensor
                   for name, tensor in tensors.items()}
        tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"] * np.float32(math.sqrt(config.hidden_size))
        if config.query_pre_attn_scalar != config.head_dim:
            scale = np.float32(math.sqrt(config.head_dim / config.query_pre_attn_scalar))
            tensors = {name: tensor * scale if name.endswith("q_norm.weight") else tensor
                       for name, tensor in tensors.items()}
    return {ours(name): tensor for name, tensor in tensors.items()}


def _rotary_bert_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """NomicBERT's and GTE's tensors under our module names (``rotary_bert.py``): transformers'
    module names (``layers.N.self_attn.q_proj``) under ``encoder.``, the saved names renamed
    (``_ROTARY_BERT_NAMES``), each fused projection split into its parts along the output axis."""
    ours = {}
    for name, tensor in tensors.items():
        name = "encoder." + name if name.startswith("layers.") else name
        for theirs, mine in _ROTARY_BERT_NAMES:
            name = name.replace(theirs, mine, 1)
        fused = next((part for part in _ROTARY_BERT_FUSED if part in name), None)
        if fused is None:
            ours[name] = tensor
            continue
        parts = _ROTARY_BERT_FUSED[fused]
        for part, piece in zip(parts, np.split(tensor, len(parts), axis=0), strict=True):
            ours[name.replace(fused, part)] = piece
    return ours


def part_width(config: BertConfig, part: str, width: int, parts: int) -> int:
    """The width of one of ``parts`` computed side by side in ``width`` columns: equal, but for
    a key or value projection shared by groups of query heads (Qwen3's)."""
    if part.endswith(("k_proj.bias", "v_proj.bias")):
        return config.kv_heads * config.head_dim
    return config.attention_width if part.endswith("q_proj.bias") else width // parts


def without_bias(config: BertConfig, name: str) -> bool:
    """Whether ``name`` is a bias a ModernBERT, decoder, NomicBERT or GTE checkpoint leaves out
    (its config says so; a decoder's MLP and classifier have none, Qwen2's output projection none,
    GTE's gate and up projections none): zero."""
    if config.alibi and name.endswith("intermediate.dense.bias"):
        return True  # (JinaBERT's gated projections have no bias)
    if not config.rotary or not name.endswith(".bias"):
        return False
    if config.decoder_layers:
        return (".mlp." in name or name.startswith("score.") or not config.linear_bias
                or (config.model_type == QWEN2 and "o_proj" in name))
    if config.post_norm_rotary and name.endswith(("gate_proj.bias", "up_proj.bias")):
        return True  # (GTE's gated MLP has a bias on its output projection only)
    if name.endswith("norm.bias"):
        return not config.norm_bias
    return not (config.classifier_bias if name.startswith("head.") else config.linear_bias)


def alibi_bias(heads: int, max_length: int) -> np.ndarray:
    """ALiBi's bias ``[heads, 2 * max_length - 1]`` by key-minus-query distance d: ``-slope * |d|``,
    the slopes a geometric series from ``2 ** (-8 / n)`` for the largest power of two n of heads
    at most ``heads``, the rest every other one of the series for 2n (the ALiBi paper's, TEI's)."""
    def series(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 1 << (heads.bit_length() - 1)
    slopes = series(n) + series(2 * n)[0::2][:heads - n]
    distance = np.abs(np.arange(1 - max_length, max_length, dtype=np.float64))
    return np.ascontiguousarray((-np.asarray(slopes)[:, None] * distance).astype(np.float32))


def relative_position_buckets(distance: np.ndarray, num_buckets: int,
                              max_distance: int = MPNET_MAX_DISTANCE) -> np.ndarray:
    """transformers' MPNet bucket of each key-minus-query ``distance``: half the buckets for keys
    after the query and half for those before, each half exact for the nearest quarter of its
    buckets, then logarithmic up to ``max_distance``, computed in float32 as transformers does."""
    half = num_buckets // 2
    exact = half // 2
    n = np.abs(distance)
    far = np.maximum(n, exact).astype(np.float32)
    logarithmic = (np.log(far / np.float32(exact)) / np.float32(math.log(max_distance / exact))
                   * np.float32(half - exact)).astype(np.int64)
    within = np.where(n < exact, n, np.minimum(exact + logarithmic, half - 1))
    return np.where(distance > 0, half, 0) + within
