"""Encoder hyper-parameters as read from a Hugging Face ``config.json``: BERT, RoBERTa's family
(RoBERTa, XLM-RoBERTa, CamemBERT: the same encoder, its positions numbered past the padding
index), DistilBERT (the same layers under other names, with no token types) and MPNet
(RoBERTa's numbering, no token types, and a bias on attention scores by relative position)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

# Activation names used by real BERT-family checkpoints. "gelu" is the exact erf form;
# the tanh approximation appears under several names.
SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish")
# model_type values whose checkpoints are BERT's layers under RoBERTa's position numbering.
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
DISTILBERT, MPNET = "distilbert", "mpnet"
MODEL_TYPES = ("bert", *ROBERTA_TYPES, DISTILBERT, MPNET)
# MPNet's relative position buckets grow logarithmically up to this distance (transformers' default).
MPNET_MAX_DISTANCE = 128
# DistilBERT's config keys -> BERT's, with DistilBertConfig's defaults; its LayerNorm epsilon is fixed.
_DISTILBERT_KEYS = {"dim": ("hidden_size", 768), "n_layers": ("num_hidden_layers", 6),
                    "n_heads": ("num_attention_heads", 12), "hidden_dim": ("intermediate_size", 3072),
                    "activation": ("hidden_act", "gelu")}


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

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ModelConfigError(f"model_type={self.model_type!r} is not supported; dietserve compiles "
                                   f"{', '.join(MODEL_TYPES)} checkpoints")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelConfigError(
                f"hidden_act={self.hidden_act!r} is not supported; expected one of {SUPPORTED_ACTIVATIONS}"
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_length <= 0:
            raise ModelConfigError(f"max_position_embeddings={self.max_position_embeddings} leaves no position "
                                   f"after the {self.position_offset} a {self.model_type} checkpoint skips")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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
    def max_length(self) -> int:
        """The longest sequence, in tokens, the position table holds."""
        return self.max_position_embeddings - self.position_offset

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> BertConfig:
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
