"""Tasks from the PrimFuncs of a compiled Relax model: any matmul-like PrimFunc (one
multiply-accumulate reduction, element-wise producers and epilogue) with symbolic dims.

The correctness reference is the same PrimFunc compiled unscheduled for the host CPU, independent
of any micro-kernel; for an operator served fused with its rows' softmax (``row_softmax``), that
reference softmaxed by numpy.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import tirx

from dietserve.kernels.tir.matching import evaluate, matmul_extents, symbolic_vars, workload_key

from .ops import OperatorSpec, Shape


def spec_from_prim_func(name: str, func: tirx.PrimFunc, row_softmax: bool = False) -> OperatorSpec:
    func = func.with_attr("global_symbol", "main")
    variables = symbolic_vars(func)
    if not variables:
        raise ValueError(f"{name} has no symbolic dimension: nothing to tune for shapes")
    extents = matmul_extents(func)
    params = [param.ty for param in func.params if isinstance(param.ty, tirx.buffer.BufferType)]
    scalars = tuple((position, param.name) for position, param in enumerate(func.params)
                    if not isinstance(param.ty, tirx.buffer.BufferType))
    reference_lib = {}

    def shapes_of(shape: Shape) -> list[tuple[int, ...]]:
        return [tuple(evaluate(extent, shape) for extent in buffer.shape) for buffer in params]

    def reference(*inputs: np.ndarray, shape: Shape | None = None) -> np.ndarray:
        """TVM's unscheduled build of the same PrimFunc. ``shape`` names the vars; without it
        they are read off input dims that are a var alone (not ``batch * seq_len``)."""
        if "lib" not in reference_lib:
            reference_lib["lib"] = tvm.compile(func, tvm.target.Target({"kind": "llvm"}))
        shape = dict(shape) if shape is not None else _vars_from(name, params, variables, inputs)
        out = tvm.runtime.tensor(np.zeros(shapes_of(shape)[-1], str(params[-1].dtype)))
        reference_lib["lib"](*spec.call_arguments(shape, [tvm.runtime.tensor(x) for x in inputs], out))
        return numpy_softmax(out.numpy()) if row_softmax else out.numpy()

    spec = OperatorSpec(
        # Timed with the softmax, its records are another workload's.
        name=f"{name}[{workload_key(func)}]" + ("+softmax" if row_softmax else ""), kind="prim_func", func=func,
        shape_vars=tuple(sorted(variables)), input_shapes=lambda shape: shapes_of(shape)[:-1],
        output_shape=lambda shape: shapes_of(shape)[-1], reference=reference,
        flops=lambda shape: 2 * math.prod(evaluate(extent, shape) for extent in extents), static=None,
        recipe=("prim_func", name, tvm.ir.save_json(func), row_softmax), scalar_params=scalars,
        row_softmax=row_softmax)
    return spec


def _vars_from(name: str, params: list, variables, inputs) -> dict[str, int]:
    shape = {}
    for buffer, array in zip(params, inputs, strict=False):
        for extent, size in zip(buffer.shape, array.shape, strict=True):
            if isinstance(extent, tirx.Var):
                shape[extent.name] = size
    missing = set(variables) - set(shape)
    if missing:
        raise ValueError(f"{name}: pass shape= to the reference; {sorted(missing)} are not input dims")
    return shape


def numpy_softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float64, returned in ``x``'s dtype."""
    wide = x.astype("float64")
    e = np.exp(wide - wide.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)
