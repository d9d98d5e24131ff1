"""Tasks from the PrimFuncs of a compiled Relax model: any matmul-like PrimFunc (one
multiply-accumulate reduction, element-wise producers and epilogue) with symbolic dims.

The reference for correctness checks is the same PrimFunc compiled unscheduled for the host CPU:
TVM's plain lowering, independent of any micro-kernel.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import s_tir, tirx

from .ops import OperatorSpec, Shape
from .schedule.common import find_matmul


def symbolic_vars(func: tirx.PrimFunc) -> dict[str, tirx.Var]:
    found = {}
    for param in func.params:
        if isinstance(param.ty, tirx.buffer.BufferType):
            for extent in param.ty.shape:
                for var in tirx.analysis.undefined_vars(extent):
                    found[var.name] = var
    return found


def evaluate(expr, variables: dict[str, tirx.Var], shape: Shape) -> int:
    from tvm.sym.analyzer import Analyzer

    analyzer = Analyzer()
    for name, var in variables.items():
        if name in shape:
            analyzer.bind(var, tirx.IntImm(str(var.ty.dtype), int(shape[name])))
    value = analyzer.simplify(expr)
    if not isinstance(value, tirx.IntImm):
        raise ValueError(f"shape {dict(shape)} does not bind every var of {expr}")
    return int(value)


def matmul_extents(func: tirx.PrimFunc) -> list:
    """The matmul block's loop extents (batch..., i, j, k) as expressions of the symbolic vars."""
    sch = s_tir.Schedule(func)
    block, _ = find_matmul(sch)
    return [sch.get(loop).extent for loop in sch.get_loops(block)]


def spec_from_prim_func(name: str, func: tirx.PrimFunc) -> OperatorSpec:
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
        return [tuple(evaluate(extent, variables, shape) for extent in buffer.shape) for buffer in params]

    def reference(*inputs: np.ndarray, shape: Shape | None = None) -> np.ndarray:
        """TVM's unscheduled build of the same PrimFunc. ``shape`` names the vars; without it
        they are read off input dims that are a var alone (not ``batch * seq_len``)."""
        if "lib" not in reference_lib:
            reference_lib["lib"] = tvm.compile(func, tvm.target.Target({"kind": "llvm"}))
        shape = dict(shape) if shape is not None else _vars_from(inputs)
        out = tvm.runtime.tensor(np.zeros(shapes_of(shape)[-1], str(params[-1].dtype)))
        reference_lib["lib"](*spec.call_arguments(shape, [tvm.runtime.tensor(x) for x in inputs], out))
        return out.numpy()

    def _vars_from(inputs) -> dict[str, int]:
        shape = {}
        for buffer, array in zip(params, inputs, strict=False):
            for extent, size in zip(buffer.shape, array.shape, strict=True):
                if isinstance(extent, tirx.Var):
                    shape[extent.name] = size
        missing = set(variables) - set(shape)
        if missing:
            raise ValueError(f"{name}: pass shape= to the reference; {sorted(missing)} are not input dims")
        return shape

    text = tvm.ir.save_json(func)
    spec = OperatorSpec(
        name=f"{name}[{text and _short_hash(func)}]",
        kind="prim_func",
        func=func,
        shape_vars=tuple(sorted(variables)),
        input_shapes=lambda shape: shapes_of(shape)[:-1],
        output_shape=lambda shape: shapes_of(shape)[-1],
        reference=reference,
        flops=lambda shape: 2 * math.prod(evaluate(extent, variables, shape) for extent in extents),
        static=None,
        recipe=("prim_func", name, text),
        scalar_params=scalars,
    )
    return spec


def _short_hash(func: tirx.PrimFunc) -> str:
    from .ops import structural_key

    return structural_key(func)
