"""BERT's hot operators as symbolic TE definitions: dense layers with fused epilogues and the two
attention batch matmuls (T symbolic in two places). Each builder returns an ``OperatorSpec``: the
PrimFunc plus what testing and timing it on a concrete shape needs (input shapes, a numpy
reference, the FLOP count)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import te, tirx

from dietserve.kernels.cpu_packed import bf16
from dietserve.kernels.cpu_packed.bf16 import precision_of
from dietserve.kernels.cpu_packed.packing import pack_array, weight_param, with_precision
from dietserve.kernels.tir.gelu import gelu_expr

Shape = Mapping[str, int]


@dataclass(frozen=True)
class OperatorSpec:
    name: str  # the workload, e.g. "dense_bias_gelu[K=768,N=3072]"
    kind: str  # "dense", "attention_scores", "attention_context"
    func: tirx.PrimFunc
    shape_vars: tuple[str, ...]
    input_shapes: Callable[[Shape], list[tuple[int, ...]]]
    output_shape: Callable[[Shape], tuple[int, ...]]
    reference: Callable[..., np.ndarray]
    flops: Callable[[Shape], int]
    static: Callable[[Shape], tirx.PrimFunc] | None  # the same operator with every var bound, no Let
    recipe: tuple = ()  # how to rebuild this spec in another process: see ``from_recipe``
    epilogue: str = "none"
    # (position, var name): symbolic dims no buffer shape gives alone (rows = batch * seq_len),
    # which Relax passes as int64 arguments.
    scalar_params: tuple[tuple[int, str], ...] = ()
    row_softmax: bool = False  # served (so timed) with its rows softmaxed by the same kernel

    @property
    def precision(self) -> str:
        """Its packed kernels' products (``bf16.PRECISION_ATTR`` on ``func``): fp32 or bf16."""
        return precision_of(self.func)

    def expected(self, shape: Shape, inputs: list[np.ndarray]) -> np.ndarray:
        if self.scalar_params:
            return self.reference(*inputs, shape=shape)
        return self.reference(*inputs)

    def call_arguments(self, shape: Shape, inputs: list, output) -> list:
        """Arguments in the PrimFunc's order: inputs, the shape's scalars, the output."""
        arguments = [*inputs, output]
        for position, name in sorted(self.scalar_params):
            arguments.insert(position, int(shape[name]))
        return arguments


def _prim_func(tensors) -> tirx.PrimFunc:
    return te.create_prim_func(tensors, index_dtype_override="int64").with_attr("global_symbol", "main")


def numpy_gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU, as BERT and Relax's legalization use."""
    from scipy.special import erf

    return (0.5 * x * (1.0 + erf(x.astype(np.float64) / math.sqrt(2.0)))).astype(x.dtype)


EPILOGUES = ("none", "bias", "bias_gelu", "bias_residual")


def _dense_func(k: int, n: int, epilogue: str, rows, bind: bool = True) -> tirx.PrimFunc:
    x = te.placeholder((rows, k), "float32", name="X")
    w = te.placeholder((k, n), "float32", name="W")
    r = te.reduce_axis((0, k), name="k")
    y = te.compute((rows, n), lambda i, j: te.sum(x[i, r] * w[r, j], axis=r), name="matmul")
    tensors = [x, w]
    if epilogue != "none":
        bias = te.placeholder((n,), "float32", name="bias")
        y = te.compute((rows, n), lambda i, j: y[i, j] + bias[j], name="add_bias")
        tensors.append(bias)
        if epilogue == "bias_gelu":  # the model's GELU (exact erf, vectorised)
            y = te.compute((rows, n), lambda i, j: gelu_expr(y[i, j], bind), name="gelu")
        if epilogue == "bias_residual":
            residual = te.placeholder((rows, n), "float32", name="residual")
            y = te.compute((rows, n), lambda i, j: y[i, j] + residual[i, j], name="add_residual")
            tensors.append(residual)
    return _prim_func([*tensors, y])


def dense(k: int, n: int, epilogue: str = "bias", precision: str = "fp32") -> OperatorSpec:
    """``Y[T, N] = X[T, K] @ W[K, N] (+ bias[N]) (-> GELU | + residual[T, N])`` with T symbolic:
    BERT's dense layers (QKV and intermediate; output projections add the residual); ``bf16``:
    its packed kernels multiply bf16 (``kernels/cpu_packed/bf16.py``)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"dense epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if k < 1 or n < 1:
        raise ValueError(f"dense needs positive K and N, got K={k} N={n}")

    def reference(x, w, bias=None, residual=None):
        y = x @ w
        if bias is not None:
            y = y + bias
        if residual is not None:
            y = y + residual
        return numpy_gelu(y) if epilogue == "bias_gelu" else y

    def input_shapes(shape: Shape):
        shapes = [(shape["T"], k), (k, n)] + ([(n,)] if epilogue != "none" else [])
        return shapes + ([(shape["T"], n)] if epilogue == "bias_residual" else [])

    func = _dense_func(k, n, epilogue, te.var("T", "int64"))
    suffix = "" if precision == "fp32" else f"+{precision}"
    return OperatorSpec(
        name=f"dense{'' if epilogue == 'none' else '_' + epilogue}[K={k},N={n}]{suffix}", kind="dense",
        func=with_precision(func, precision), shape_vars=("T",),
        input_shapes=input_shapes, output_shape=lambda shape: (shape["T"], n),
        reference=reference, flops=lambda shape: 2 * shape["T"] * k * n,
        # Without Let bindings: MetaSchedule's FLOP estimate fails on a Let.
        static=lambda shape: _dense_func(k, n, epilogue, shape["T"], bind=False),
        recipe=("dense", k, n, epilogue, precision), epilogue=epilogue)


def _batch_matmul(kind: str, names: tuple[str, str], heads: int, head_dim: int, batch: int,
                  dims: Callable[[object], tuple[tuple, tuple, tuple]]) -> OperatorSpec:
    """``C[BH, m, n] = A[BH, m, k] @ B[BH, k, n]``, with ``dims(T)`` giving A's, B's and C's
    shapes (without BH) for a sequence length T: a var, or an int for the static operator."""
    bh = batch * heads

    def build(length):
        (m, k), b_shape, c_shape = dims(length)
        a = te.placeholder((bh, m, k), "float32", name=names[0])
        b = te.placeholder((bh, *b_shape), "float32", name=names[1])
        r = te.reduce_axis((0, k), name="k")
        c = te.compute((bh, *c_shape), lambda z, i, j: te.sum(a[z, i, r] * b[z, r, j], axis=r), name="matmul")
        return _prim_func([a, b, c])

    return OperatorSpec(
        name=f"{kind}[BH={bh},d={head_dim}]", kind=kind, func=build(te.var("T", "int64")), shape_vars=("T",),
        input_shapes=lambda shape: [(bh, *dims(shape["T"])[0]), (bh, *dims(shape["T"])[1])],
        output_shape=lambda shape: (bh, *dims(shape["T"])[2]), reference=lambda a, b: a @ b,
        flops=lambda shape: 2 * bh * shape["T"] ** 2 * head_dim, static=lambda shape: build(shape["T"]),
        recipe=(kind, heads, head_dim, batch))


def attention_scores(heads: int = 12, head_dim: int = 64, batch: int = 1) -> OperatorSpec:
    """``S[B*H, T, T] = Q[B*H, T, d] @ Kt[B*H, d, T]``: T symbolic in both output dims."""
    return _batch_matmul("attention_scores", ("Q", "Kt"), heads, head_dim, batch,
                         lambda t: ((t, head_dim), (head_dim, t), (t, t)))


def attention_context(heads: int = 12, head_dim: int = 64, batch: int = 1) -> OperatorSpec:
    """``O[B*H, T, d] = P[B*H, T, T] @ V[B*H, T, d]``: T symbolic in a spatial and the reduction dim."""
    return _batch_matmul("attention_context", ("P", "V"), heads, head_dim, batch,
                         lambda t: ((t, t), (t, head_dim), (t, head_dim)))


def from_recipe(recipe: tuple | list) -> OperatorSpec:
    """Rebuild a spec from its ``recipe`` (what worker processes receive)."""
    kind, *args = recipe
    if kind == "prim_func":
        from .extract import spec_from_prim_func

        name, text, row_softmax = args
        return spec_from_prim_func(name, tvm.ir.load_json(text), row_softmax=row_softmax)
    builders = {"dense": dense, "attention_scores": attention_scores, "attention_context": attention_context}
    if kind not in builders:
        raise ValueError(f"unknown operator kind {kind!r}; expected one of {sorted(builders)} or 'prim_func'")
    return builders[kind](*args)


def random_inputs(spec: OperatorSpec, shape: Shape, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, size).astype("float32") for size in spec.input_shapes(shape)]


def rounded_operands(inputs: list[np.ndarray], rounding: str) -> list[np.ndarray]:
    """``inputs`` with the product's operands (the first two, in every spec here) rounded as a
    kernel multiplies them: ``bf16`` (``kernels/cpu_packed/bf16.py``) or ``fp16`` (tensor cores)."""
    if rounding == "bf16":
        rounded = bf16.bf16_rounded
    elif rounding == "fp16":
        rounded = lambda x: x.astype(np.float16).astype(np.float32)  # noqa: E731
    else:
        raise ValueError(f"rounding must be bf16 or fp16, got {rounding!r}")
    return [rounded(x) if i < 2 else x for i, x in enumerate(inputs)]


def kernel_inputs(spec: OperatorSpec, inputs: list[np.ndarray], pack: int) -> list[np.ndarray]:
    """``inputs`` as a kernel reads them: the weight in panels of ``pack`` (0: as they are), as
    bf16 pairs where the operator is bf16."""
    if not pack:
        return inputs
    index = weight_input(spec)
    packing = bf16.pack_array if spec.precision == "bf16" else pack_array
    return [packing(x, pack) if i == index else x for i, x in enumerate(inputs)]


def weight_input(spec: OperatorSpec) -> int | None:
    """The position of the constant weight among ``spec``'s inputs (``random_inputs``' order,
    which leaves out the PrimFunc's scalar params); None if the operator has none."""
    found = weight_param(spec.func)
    if found is None:
        return None
    param = found[0]
    return param - sum(1 for position, _ in spec.scalar_params if position < param)

