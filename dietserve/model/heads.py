"""What a checkpoint puts on top of the encoder, as data and as Relax modules.

- A sentence-transformers embedding recipe: one or more pooling modes (concatenated in the
  order the checkpoint lists them), then Dense layers, then an optional L2 normalisation;
  each mode computed as sentence-transformers' ``Pooling._forward_padded`` does, so left- or
  right-padded batches and rows without any attended token give the same vectors.
- A sparse encoder's (SPLADE's): the masked-language-model head on every token, then the
  logits pooled into one weight per vocabulary entry (``SpladeOptions``, ``SpladeHead``).
- A sequence-classification head's labels (its modules, pooler and classifier, are BERT's own
  and live in ``bert.py``).

Both stay inside the compiled graph: a request is still one call into the VM.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..kernels.cpu_varlen.splade_pool import check_splade_pooling
from .layers import TransposedLinear, activation
from .tokenizer import PairTemplate

# --pooling's name for SpladePooling (TEI's): sentence-transformers' Pooling modes do not include it.
SPLADE_POOLING = "splade"
# sentence-transformers' names, in the order its legacy ``pooling_mode_*`` flags concatenate.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
DENSE_ACTIVATIONS = ("identity", "tanh", "relu", "gelu", "sigmoid")
# A sparse encoder's decoder is widened to a multiple of this many columns (zero weights): every
# packed dense kernel's task width divides it, where a vocabulary's own size (30,522 = 2 x 3 x
# 5,087) fits none and would leave its largest product to the default rule.
DECODER_COLUMNS = 768
# Beyond any position (and exact in float32 when added to one): marks padding in a minimum
# over positions.
_NO_TOKEN = float(1 << 20)


def parse_pooling_modes(text: str) -> tuple[str, ...]:
    """``"cls"`` or ``"cls,mean"`` (concatenated in that order) -> the modes, checked; or
    ``"splade"`` alone (``SPLADE_POOLING``: a masked-language model as a sparse encoder)."""
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    if SPLADE_POOLING in modes:
        if modes != (SPLADE_POOLING,):
            raise ValueError(f"pooling {text!r}: {SPLADE_POOLING} pools a masked-language model's logits, with no "
                             "other mode")
        return modes
    unknown = [mode for mode in modes if mode not in POOLING_MODES]
    if unknown or not modes:
        raise ValueError(f"unknown pooling mode {', '.join(map(repr, unknown)) or repr(text)}; "
                         f"expected one or more of {', '.join(POOLING_MODES)}, separated by commas")
    return modes


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module: ``activation(x @ W.T + b)``."""

    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "tanh"
    path: str = ""  # its folder in the checkpoint, which holds its weights

    def __post_init__(self) -> None:
        if self.activation not in DENSE_ACTIVATIONS:
            raise ValueError(f"Dense activation {self.activation!r} is not supported; "
                             f"expected one of {', '.join(DENSE_ACTIVATIONS)}")


@dataclass(frozen=True)
class SpladeOptions:
    """sentence-transformers' ``SpladePooling`` over the masked-language-model logits:
    ``strategy`` (max or sum over the tokens) of ``log1p(relu(x))``, or of ``log1p`` of that
    (``activation`` ``log1p_relu``): one weight per vocabulary entry, most of them zero; and the
    SparseEncoder's ``max_active_dims``."""

    vocab_size: int
    strategy: str = "max"
    activation: str = "relu"
    # SparseEncoder's max_active_dims: each text keeps its this many largest weights, the rest
    # zero (the engine keeps them, on the host); None: every weight.
    max_active_dims: int | None = None

    def __post_init__(self) -> None:
        if self.max_active_dims is not None and (type(self.max_active_dims) is not int or self.max_active_dims < 1):
            raise ValueError(f"max_active_dims must be a positive integer, got {self.max_active_dims!r}")
        check_splade_pooling(self.strategy, self.activation)

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "activation": self.activation, "max_active_dims": self.max_active_dims}

    @property
    def decoder_columns(self) -> int:
        """The decoder's width: the vocabulary, up to a multiple of ``DECODER_COLUMNS``."""
        return -(-self.vocab_size // DECODER_COLUMNS) * DECODER_COLUMNS


@dataclass(frozen=True)
class PoolingOptions:
    """How the sentence embedding is derived from the last hidden state: pooled ``modes``, or,
    for a sparse encoder, ``splade`` (then ``modes``, ``dense`` and ``normalize`` are unused)."""

    modes: tuple[str, ...] = ("mean",)
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = False  # L2-normalise last (sentence-transformers' Normalize module)
    splade: SpladeOptions | None = None

    def __post_init__(self) -> None:
        if SPLADE_POOLING in parse_pooling_modes(",".join(self.modes)):
            raise ValueError(f"{SPLADE_POOLING} is not a mode of sentence-transformers' Pooling: set splade")

    def embedding_size(self, hidden_size: int) -> int:
        if self.splade is not None:
            return self.splade.vocab_size
        return self.dense[-1].out_features if self.dense else len(self.modes) * hidden_size

    def to_dict(self) -> dict:
        if self.splade is not None:  # the dense recipe's fields do not apply: not recorded
            return {"splade": self.splade.to_dict()}
        dense = [{"in_features": d.in_features, "out_features": d.out_features, "bias": d.bias,
                  "activation": d.activation, "path": d.path} for d in self.dense]
        return {"modes": list(self.modes), "dense": dense, "normalize": self.normalize}


@dataclass(frozen=True)
class ClassifierOptions:
    """A sequence-classification head: ``labels[i]`` names logit ``i``. A decoder's reads the
    last attended token whose id is not ``pad_token_id`` (transformers' rule: a text may end in
    the padding token, as an end-of-text token; None: the last attended token). ``from_tokens``
    (no, yes): a causal language model's head made one label, the logit of ``yes`` minus that of
    ``no`` (its sigmoid is their softmax's yes: Qwen3-Reranker's score). ``pair_template``: the
    prompt a pair is read through (``tokenizer.PairTemplate``)."""

    labels: tuple[str, ...]
    pad_token_id: int | None = None
    from_tokens: tuple[int, int] | None = None
    pair_template: PairTemplate | None = None

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def to_dict(self) -> dict:
        skipped = {} if self.pad_token_id is None else {"pad_token_id": self.pad_token_id}
        tokens = {} if self.from_tokens is None else {"from_tokens": list(self.from_tokens)}
        template = {} if self.pair_template is None else {"pair_template": self.pair_template.to_dict()}
        return {"num_labels": self.num_labels, "id2label": {str(i): label for i, label in enumerate(self.labels)},
                **skipped, **tokens, **template}


def _activation(x: nn.Tensor, name: str) -> nn.Tensor:
    if name == "tanh":
        return op.tanh(x)
    if name == "relu":
        return op.relu(x)
    if name == "gelu":  # torch.nn.GELU's default: the exact erf form
        return op.gelu(x)
    if name == "sigmoid":
        return op.sigmoid(x)
    return x


class DenseModule(nn.Module):
    """``DenseLayer`` with its weight stored ``[in, out]`` like the encoder's linear layers."""

    def __init__(self, layer: DenseLayer):
        self.weight = nn.Parameter((layer.in_features, layer.out_features), "float32")
        self.weight.stored_transposed = True
        self.bias = nn.Parameter((layer.out_features,), "float32") if layer.bias else None
        self.activation = layer.activation

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = op.matmul(x, self.weight)
        return _activation(y + self.bias if self.bias is not None else y, self.activation)


def _const(value: float) -> nn.Tensor:
    return nn.Tensor.from_const(value)


def _weighted_sum(hidden: nn.Tensor, weights: nn.Tensor) -> nn.Tensor:
    """``sum_s hidden[b, s, :] * weights[b, s]``."""
    batch, seq = weights.shape
    return op.sum(hidden * op.reshape(weights, (batch, seq, 1)), axis=1)


def _one_hot(positions: nn.Tensor, index: nn.Tensor) -> nn.Tensor:
    """``[b, s]``: 1.0 where the position equals the row's ``index`` (exact: small integers)."""
    (seq,), (batch,) = positions.shape, index.shape
    hit = op.equal(op.reshape(positions, (1, seq)), op.reshape(index, (batch, 1)))
    return op.astype(hit, "float32")


def _first_token(mask: nn.Tensor, positions: nn.Tensor) -> nn.Tensor:
    """``[b]``: each row's first attended position, 0 in a row with none (as
    ``attention_mask.argmax(dim=1)``, sentence-transformers' "pad length")."""
    first = op.min(positions + (1.0 - mask) * _NO_TOKEN, axis=1)
    return first - op.astype(op.greater_equal(first, _const(_NO_TOKEN)), "float32") * _NO_TOKEN


def _mean_parts(hidden: nn.Tensor, mask: nn.Tensor) -> tuple[nn.Tensor, nn.Tensor]:
    counts = op.maximum(op.sum(mask, axis=1, keepdims=True), _const(1e-9))
    return _weighted_sum(hidden, mask), counts


def pool(mode: str, hidden: nn.Tensor, mask: nn.Tensor, positions: nn.Tensor) -> nn.Tensor:
    """One pooling mode: ``hidden [b, s, h]``, ``mask [b, s]`` and ``positions [s]`` as
    float32 -> ``[b, h]``."""
    if mode in ("mean", "mean_sqrt_len_tokens"):
        summed, counts = _mean_parts(hidden, mask)
        return summed / (counts if mode == "mean" else op.sqrt(counts))
    if mode == "cls":  # the first attended token, not masked (as sentence-transformers gathers it)
        return _weighted_sum(hidden, _one_hot(positions, _first_token(mask, positions)))
    if mode == "lasttoken":  # the last attended token; zeros in a row with none
        last = op.max(mask * positions, axis=1)
        return _weighted_sum(hidden, _one_hot(positions, last) * mask)
    if mode == "weightedmean":  # weights 1, 2, ... from the first attended token on
        first = op.reshape(_first_token(mask, positions), (mask.shape[0], 1))
        weights = mask * (positions + 1.0 - first)
        total = op.maximum(op.sum(weights, axis=1, keepdims=True), _const(1e-9))
        return _weighted_sum(hidden, weights) / total
    if mode == "max":  # padding excluded as -inf, as sentence-transformers' masked_fill
        batch, seq = mask.shape
        minus_inf = _const(float("-inf"))
        attended = op.greater(op.reshape(mask, (batch, seq, 1)), _const(0.0))
        largest = op.max(op.where(attended, hidden, minus_inf), axis=1)
        # TVM's max starts from the lowest finite float, so a row without tokens needs its -inf set
        return op.where(op.greater(op.sum(mask, axis=1, keepdims=True), _const(0.0)), largest, minus_inf)
    raise ValueError(f"unknown pooling mode {mode!r}")


class SentencePooling(nn.Module):
    """``PoolingOptions`` as a module: pooled modes side by side, Dense layers, Normalize."""

    def __init__(self, options: PoolingOptions):
        self.modes = options.modes
        self.normalize = options.normalize
        self.dense = nn.ModuleList([DenseModule(layer) for layer in options.dense])

    def forward(self, hidden: nn.Tensor, mask: nn.Tensor, positions: nn.Tensor) -> nn.Tensor:
        pooled = [pool(mode, hidden, mask, positions) for mode in self.modes]
        embedding = pooled[0] if len(pooled) == 1 else op.concat(pooled, dim=1)
        for layer in self.dense:
            embedding = layer(embedding)
        if not self.normalize:
            return embedding
        # torch.nn.functional.normalize: x / max(||x||, 1e-12).
        norm = op.sqrt(op.sum(embedding * embedding, axis=1, keepdims=True))
        return embedding / op.maximum(norm, _const(1e-12))


class _LMTransform(nn.Module):
    """The masked-language-model head's first part: dense, activation, LayerNorm (BERT's
    ``cls.predictions.transform``; RoBERTa's and MPNet's ``lm_head.dense`` and ``layer_norm``,
    whose activation is always GELU; DistilBERT's ``vocab_transform`` and ``vocab_layer_norm``)."""

    def __init__(self, hidden_size: int, act: str, eps: float):
        self.dense = TransposedLinear(hidden_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)
        self.act = act

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.LayerNorm(activation(self.dense(x), self.act))


class SpladeHead(nn.Module):
    """A sparse encoder's head (BERT's ``cls.predictions``, renamed at load): every token's logits
    over the vocabulary (``logits``, the decoder's zero columns past the vocabulary to be left
    out), then their pooling, on packed rows by ``pool_packed``
    (``kernels/cpu_varlen/splade_pool.py``) or on ``[batch, seq]`` rows here, padding as zero
    logits, as sentence-transformers masks it."""

    def __init__(self, hidden_size: int, act: str, eps: float, options: SpladeOptions):
        self.transform = _LMTransform(hidden_size, act, eps)
        self.decoder = TransposedLinear(hidden_size, options.decoder_columns)
        self.options = options

    def logits(self, rows: nn.Tensor) -> nn.Tensor:
        """``[rows, hidden]`` -> ``[rows, decoder_columns]``."""
        return self.decoder(self.transform(rows))

    def pool_packed(self, rows: nn.Tensor, starts: nn.Tensor, batch, kernel) -> nn.Tensor:
        out = nn.Tensor.placeholder((batch, self.options.vocab_size), "float32")
        return op.tensor_ir_op(kernel, "splade_pool", [self.logits(rows), starts], out)

    def pool_padded(self, rows: nn.Tensor, mask: nn.Tensor) -> nn.Tensor:
        """``rows`` ``[batch * seq, hidden]``, ``mask`` ``[batch, seq]`` float32 -> ``[batch, vocab]``."""
        batch, seq = mask.shape
        vocab = self.options.vocab_size
        words = nn.op.wrap_nested(relax.op.strided_slice(self.logits(rows)._expr, [1], [0], [vocab]), "vocabulary")
        logits = op.reshape(words, (batch, seq, vocab))
        # (Relax has no log1p: below 6e-8, where log(1 + x) rounds to 0, log1p's x is as far from it)
        values = op.log(op.relu(logits * op.reshape(mask, (batch, seq, 1))) + 1.0)
        if self.options.activation == "log1p_relu":
            values = op.log(values + 1.0)
        return op.max(values, axis=1) if self.options.strategy == "max" else op.sum(values, axis=1)
