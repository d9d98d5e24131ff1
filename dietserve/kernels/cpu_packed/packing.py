"""Weight packing: a dense layer's constant operand laid out once in the micro-kernel's panel
order, so the inner loop streams it contiguously and no request pays for a copy.

``W[K, N]`` (the model stores linear weights input-major) becomes ``Wp[N / panel, K, panel]``:
``panel``-wide column panels, reduction-major inside each panel. One packing per operator: every
variant linked into it reads the same packed tensor. The PrimFunc side (``pack_prim_func``) and
the data side (``pack_array``, and ``index_map`` for Relax's ``layout_transform``) are one map.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import s_tir, tirx

from ..tir.matching import ScheduleMismatch, find_matmul
from . import bf16


def index_map(panel: int):
    from tvm.tirx import IndexMap

    return IndexMap.from_func(lambda k, n: (n // panel, k, n % panel), index_dtype="int64")


def pack_array(weight: np.ndarray, panel: int) -> np.ndarray:
    """``[K, N]`` -> ``[N / panel, K, panel]`` (numpy; what ``index_map`` does in Relax)."""
    k, n = weight.shape
    if n % panel:
        raise ValueError(f"cannot pack {n} columns into panels of {panel}")
    return np.ascontiguousarray(weight.reshape(k, n // panel, panel).transpose(1, 0, 2))


def _weight_read(sch: s_tir.Schedule, func: tirx.PrimFunc):
    """(matmul block, read index, param index, K, N) of the matmul's second operand when it is
    a static ``[K, N]`` parameter read as ``B[k, j]`` (a dense layer's weight), else None."""
    try:
        block, _ = find_matmul(sch)
    except ScheduleMismatch:
        return None
    stmt = sch.get(block)
    *_, j_var, k_var = [iv.var for iv in stmt.iter_vars]
    for index, region in enumerate(stmt.reads):
        starts = [r.min for r in region.region]
        if len(starts) != 2 or not (starts[0].same_as(k_var) and starts[1].same_as(j_var)):
            continue
        shape = [d for d in region.source.shape]
        if not all(isinstance(d, tirx.IntImm) for d in shape):
            return None
        for position, param in enumerate(func.params):
            if param.same_as(region.source):  # a buffer parameter is the buffer itself
                return block, index, position, int(shape[0]), int(shape[1])
    return None


def weight_param(func: tirx.PrimFunc) -> tuple[int, int, int] | None:
    """(param index, K, N) of a dense layer's weight parameter, None if ``func`` has none."""
    found = _weight_read(s_tir.Schedule(func), func)
    return None if found is None else found[2:]


PACKING_ATTR = "dietserve.packing"  # panel width, on a PrimFunc that reads its weight packed


def packed_panel(func: tirx.PrimFunc) -> int:
    """The panel width ``func`` reads its weight in; 0 if unpacked."""
    return int(func.attrs[PACKING_ATTR]) if func.attrs is not None and PACKING_ATTR in func.attrs else 0


def with_precision(func: tirx.PrimFunc, precision: str) -> tirx.PrimFunc:
    """``func`` marked to be built with ``precision``'s products where it is a dense layer (a
    static weight to pack); any other operator, and fp32, as it is."""
    if precision == "fp32" or weight_param(func) is None:
        return func
    return func.with_attr(bf16.PRECISION_ATTR, precision)


def packed_form(func: tirx.PrimFunc, panel: int) -> tirx.PrimFunc:
    """``func`` reading its weight in panels of ``panel`` (packed here unless it already is):
    fp32 panels, or bf16 pairs where ``func`` asks for bf16 products (``bf16.PRECISION_ATTR``)."""
    have = packed_panel(func)
    if have == panel:
        return func
    if have:
        raise ScheduleMismatch(f"the weight is packed in panels of {have}, the kernel reads panels of {panel}")
    packed = pack_prim_func(func, panel)
    if bf16.precision_of(func) != "bf16":
        return packed
    found = weight_param(func)
    try:
        return bf16.bf16_form(packed, packed.params[found[0]])
    except ValueError as err:
        raise ScheduleMismatch(str(err)) from err


def pack_prim_func(func: tirx.PrimFunc, panel: int) -> tirx.PrimFunc:
    """``func`` rewritten to read its weight parameter (``weight_param``) in panels of ``panel``."""
    sch = s_tir.Schedule(func)
    found = _weight_read(sch, func)
    if found is None:
        raise ScheduleMismatch("no static [K, N] weight parameter to pack")
    block, read, _, _, n = found
    if n % panel:
        raise ScheduleMismatch(f"N={n} is not a multiple of the panel width {panel}")
    if any(param.same_as(sch.get(block).writes[0].source) for param in func.params):
        raise ScheduleMismatch("packing needs an epilogue after the matmul (its result is the output)")
    # The weight, the matmul's result and its iteration space all in panel form, so the block is
    # again an einsum, C[i, jo, ji] += X[i, k] * Wp[jo, k, ji], which the schedules can pad.
    sch.transform_block_layout(block, lambda i, j, k: (i, j // panel, j % panel, k))
    sch.transform_layout(block, ("read", read), index_map(panel))
    sch.transform_layout(block, ("write", 0), lambda *axes: (*axes[:-1], axes[-1] // panel, axes[-1] % panel))
    return tvm.tirx.transform.StmtSimplify()(sch.mod)["main"].with_attr(PACKING_ATTR, panel)
