"""The parts BERT's encoder (``bert.py``), ModernBERT's (``modernbert.py``) and the decoders
(``decoders.py``) are built from: the linear layer stored transposed, the clamped row lookup, the
activations, and attention in either layout (``PaddedAttention`` over ``[batch, seq]`` rows,
``PackedAttention`` over packed sequences in one kernel), with a bias on the scores by distance
where a model has one (MPNet's relative positions, ModernBERT's sliding window, a decoder's
causal mask) and key and value heads shared by groups of query heads where they are."""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

# torch.finfo(torch.float32).min: the additive mask value Hugging Face uses, so masked
# keys get exactly zero attention weight in both implementations.
MASK_FILL = -3.4028234663852886e38


class TransposedLinear(nn.Module):
    """``y = x @ weight + bias`` with ``weight`` stored as ``[in_features, out_features]``.

    ``parts``: the checkpoint's linear layers (siblings of this one) whose outputs this one
    computes side by side, in order; empty for a layer of the checkpoint's own."""

    def __init__(self, in_features: int, out_features: int, parts: tuple[str, ...] = ()):
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter((in_features, out_features), "float32")
        self.weight.stored_transposed = True
        self.bias = nn.Parameter((out_features,), "float32")
        self.weight.parts = self.bias.parts = parts

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return op.matmul(x, self.weight) + self.bias


class Embedding(nn.Module):
    """Row lookup whose indices are clamped into the table.

    The engine rejects out-of-vocabulary ids before a call; clamping in the kernel as well
    means a request that slips past validation reads a wrong row, never memory outside the
    table (TVM's default "fast" take does no check at all).
    """

    def __init__(self, num: int, dim: int):
        self.weight = nn.Parameter((num, dim), "float32")

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        return take_rows(self.weight, ids)


def take_rows(table: nn.Tensor, ids: nn.Tensor) -> nn.Tensor:
    """``table``'s rows at ``ids`` (any shape), clamped into the table (``Embedding``)."""
    flat = op.reshape(ids, (-1,))
    rows = nn.op.wrap_nested(relax.op.take(table._expr, flat._expr, axis=0, mode="clip"), "take")
    return op.reshape(rows, (*ids.shape, table.shape[1]))


def token_rows(table: Embedding, input_ids: nn.Tensor) -> nn.Tensor:
    """The ids' rows of ``table`` as the layers take them: ``[batch * seq, width]`` for padded
    ``[batch, seq]`` ids, ``[T, width]`` for packed ones."""
    words = table(input_ids)
    if len(input_ids.shape) == 1:
        return words
    batch, seq = input_ids.shape
    return op.reshape(words, (batch * seq, words.shape[-1]))


def activation(x: nn.Tensor, name: str) -> nn.Tensor:
    if name == "gelu":
        return op.gelu(x)
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return op.gelu(x, approximate="tanh")
    if name == "relu":
        return op.relu(x)
    if name in ("silu", "swish"):
        return op.silu(x)
    raise ValueError(f"unsupported activation {name!r}")


class PaddedAttention:
    """Attention over ``[batch, seq]`` rows, padding masked out by an additive bias
    (``[batch, 1, 1, seq]``): two batch matmuls and a softmax, the dynamic operators the tuner
    plans. ``position_bias`` (MPNet's, ``[1, heads, seq, seq]``) is added to the scores too."""

    def __init__(self, mask_bias: nn.Tensor, position_bias: nn.Tensor | None = None):
        self.mask_bias = mask_bias
        self.position_bias = position_bias

    def __call__(self, qkv: nn.Tensor, heads: int, head_dim: int, kv_heads: int | None = None) -> nn.Tensor:
        """``kv_heads``: key and value heads, each shared by ``heads / kv_heads`` query heads (None: one each)."""
        batch, _, _, seq = self.mask_bias.shape
        width, kv_heads = heads * head_dim, heads if kv_heads is None else kv_heads
        # [b, s, heads + 2 * kv_heads, d]: the queries', keys' and values' heads side by side (a free view)
        projected = op.reshape(qkv, (batch, seq, heads + 2 * kv_heads, head_dim))

        def part(begin: int, end: int, order: list[int]) -> nn.Tensor:
            # its heads: a slice that fuses with the permute after it into one copy; a shared
            # head repeated for each query head of its group
            sliced = nn.op.wrap_nested(relax.op.strided_slice(projected._expr, [2], [begin], [end]), "qkv_part")
            heads_first = op.permute_dims(sliced, order)
            return heads_first if end - begin == heads else op.repeat(heads_first, heads // (end - begin), axis=1)

        q = part(0, heads, [0, 2, 1, 3])  # b h s d
        k = part(heads, heads + kv_heads, [0, 2, 3, 1])  # b h d s
        v = part(heads + kv_heads, heads + 2 * kv_heads, [0, 2, 1, 3])  # b h s d
        scores = op.matmul(q, k) * (1.0 / math.sqrt(head_dim)) + self.mask_bias
        if self.position_bias is not None:
            scores = scores + self.position_bias
        probs = op.softmax(scores, axis=-1)
        context = op.matmul(probs, v)  # b h s d
        return op.reshape(op.permute_dims(context, [0, 2, 1, 3]), (batch * seq, width))


class PackedAttention:
    """Attention over packed sequences (``[T]`` rows, ``starts``: where each sequence begins, the
    last entry T): each attends to itself over its own length, no mask and no padded work, in
    one kernel (``kernel``: ``kernels/cpu_varlen/attention.py``, built for the target), which adds
    ``relative_bias`` (MPNet's, by distance: ``BertEncoder.relative_bias``) where there is one."""

    def __init__(self, starts: nn.Tensor, kernel: tvm.tirx.PrimFunc, relative_bias: nn.Tensor | None = None,
                 name: str = "varlen_attention"):
        self.starts, self.kernel, self.name = starts, kernel, name
        self.relative_bias = () if relative_bias is None else (relative_bias,)

    def __call__(self, qkv: nn.Tensor, heads: int, head_dim: int, kv_heads: int | None = None) -> nn.Tensor:
        """(``kv_heads``: built into the kernel, ``varlen_attention(kv_heads=)``.)"""
        out = nn.Tensor.placeholder((qkv.shape[0], heads * head_dim), "float32")
        return op.tensor_ir_op(self.kernel, self.name, [qkv, self.starts, *self.relative_bias], out)


def bias_by_distance(table: nn.Tensor, position_ids: nn.Tensor) -> nn.Tensor:
    """``[1, heads, seq, seq]`` from a ``[heads, 2 * max_length - 1]`` ``table`` by key-minus-query
    distance (``BertEncoder.relative_bias``'s layout), for each query and key of ``[seq]`` positions."""
    heads, width = table.shape
    seq = position_ids.shape[0]
    distance = op.reshape(position_ids, (1, seq)) - op.reshape(position_ids, (seq, 1))
    index = op.reshape(distance, (-1,)) + op.full((1,), (width - 1) // 2, "int64")
    rows = nn.op.wrap_nested(relax.op.take(table._expr, index._expr, axis=1, mode="clip"), "position_bias")
    return op.reshape(rows, (1, heads, seq, seq))
