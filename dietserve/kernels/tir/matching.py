"""Which PrimFuncs are matmul-like operators, and their shape as data.

Used by the CPU default rule, the micro-kernel schedules, the link pass (matching a model's
PrimFuncs to tuned plans by structure) and the tuner (tasks from a model's PrimFuncs).
Shape quantities cross files as expression text over the PrimFunc's symbolic vars
(``"batch * seq_len"``), evaluated here for concrete shapes or rebuilt as TIR.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func

from ..plan.decision_tree import evaluate_text
from .loops import static_extent


class ScheduleMismatch(ValueError):
    """The PrimFunc is not a matmul-like operator this micro-kernel can be applied to."""


def find_matmul(sch: s_tir.Schedule):
    """Normalize and return (matmul block, epilogue block or None) after inlining the rest:
    one reduction block with spatial axes then one reduction axis, element-wise producers
    folded into its reads and all but the last element-wise consumer into that last one."""
    infos = normalize_prim_func(sch)
    if infos is None:
        raise ScheduleMismatch("blocks are not in a normal form")
    reductions = [info for info in infos if not info.is_injective()]
    if len(reductions) != 1:
        raise ScheduleMismatch(f"expected one reduction block, found {len(reductions)}")
    matmul = reductions[0]
    kinds = matmul.dom_kind()
    if len(kinds) < 3 or kinds != "S" * (len(kinds) - 1) + "R":
        raise ScheduleMismatch(f"expected spatial axes then one reduction axis, got {kinds!r}")
    position = infos.index(matmul)
    producers, consumers = infos[:position], infos[position + 1 :]
    try:
        for info in reversed(producers):
            sch.compute_inline(info.block_rv)
        for info in consumers[:-1]:
            sch.compute_inline(info.block_rv)
    except s_tir.ScheduleError as err:
        raise ScheduleMismatch(f"cannot fold producers/epilogue into the tile: {err}") from err
    return matmul.block_rv, (consumers[-1].block_rv if consumers else None)


def is_multiply_accumulate(block) -> bool:
    """``C[...] = C[...] + A[...] * B[...]`` (loads may be wrapped in casts), two factors that
    differ: a sum of squares (RMSNorm's) has a matmul's loops but no matmul's operands."""
    import tvm
    import tvm_ffi

    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return False
    acc, product = store.value.a, store.value.b
    return (isinstance(acc, tvm.ir.TensorLoad) and acc.source.same_as(store.buffer) and isinstance(product, tirx.Mul)
            and not tvm_ffi.structural_equal(product.a, product.b))


def pad_to_tiles(sch: s_tir.Schedule, block, epilogue, tiles: Sequence[int]):
    """Pad the matmul's innermost loops (i, j, k; or packed i, jo, ji, k) to multiples
    of ``tiles`` where an axis is symbolic or not a whole number of tiles. Returns (padded?,
    the block writing the real output): the un-pad copy is folded into the epilogue, or
    becomes the write-back itself."""
    loops = sch.get_loops(block)
    batch, tiled = loops[: len(loops) - len(tiles)], loops[len(loops) - len(tiles) :]
    padding = []
    for loop, tile in zip(tiled, tiles, strict=True):
        extent = static_extent(sch.get(loop).extent)
        padding.append(1 if extent is not None and extent % tile == 0 else tile)
    if all(p == 1 for p in padding):
        return False, epilogue
    try:
        sch.pad_einsum(block, [1] * len(batch) + padding)
    except s_tir.ScheduleError as err:
        raise ScheduleMismatch(f"cannot pad to whole tiles: {err}") from err
    unpad = sch.get_consumers(block)[0]
    if epilogue is None:
        return True, unpad
    sch.compute_inline(unpad)
    return True, epilogue


def stage_result(sch: s_tir.Schedule, block, epilogue, padded: bool, at):
    """Keep the matmul's result in a workspace local to loop ``at`` and write it back from there
    (DietCode's local padding for the output). Returns (the write-back block, the epilogue if it
    had to be placed as a block of its own, else None)."""
    if padded:  # the padded result lives only in the workspace; the epilogue writes real elements
        sch.set_scope(block, 0, "local")
        sch.reverse_compute_at(epilogue, at, preserve_unit_loops=True)
        return epilogue, None
    writer = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(writer, at, preserve_unit_loops=True)
    if epilogue is None:
        return writer, None
    try:
        sch.reverse_compute_inline(epilogue)
        return writer, None
    except s_tir.ScheduleError:
        sch.reverse_compute_at(epilogue, at, preserve_unit_loops=True)
        return writer, epilogue


# -- the operator's shape ------------------------------------------------------------------

def symbolic_vars(func: tirx.PrimFunc) -> dict[str, tirx.Var]:
    """Name -> var for every symbolic var in the PrimFunc's buffer shapes."""
    found = {}
    for param in func.params:
        if isinstance(param.ty, tirx.buffer.BufferType):
            for extent in param.ty.shape:
                for var in tirx.analysis.undefined_vars(extent):
                    found[var.name] = var
    return found


def matmul_extents(func: tirx.PrimFunc) -> list:
    """The matmul block's loop extents (batch..., i, j, k) as expressions of the symbolic vars;
    raises ScheduleMismatch when ``func`` is not matmul-like."""
    sch = s_tir.Schedule(func)
    block, _ = find_matmul(sch)
    if not is_multiply_accumulate(sch.get(block)):
        raise ScheduleMismatch("the reduction is not a multiply-accumulate")
    return [sch.get(loop).extent for loop in sch.get_loops(block)]


def matmul_axes(func: tirx.PrimFunc) -> dict[str, str]:
    """The matmul's axes as expression text: ``b`` (product of batch axes), ``i``, ``j``, ``k``."""
    *batch, i, j, k = matmul_extents(func)
    b = " * ".join(f"({expr_text(e)})" if isinstance(e, tirx.Add | tirx.Sub) else expr_text(e) for e in batch)
    return {"b": b or "1", "i": expr_text(i), "j": expr_text(j), "k": expr_text(k)}


def is_dynamic_matmul(func: object) -> bool:
    """A matmul-like PrimFunc with a symbolic dim: what a tuned plan may replace."""
    if not isinstance(func, tirx.PrimFunc) or not symbolic_vars(func):
        return False
    try:
        matmul_extents(func)
    except (ScheduleMismatch, s_tir.ScheduleError):
        return False
    return True


# Attributes that name or tag a function without changing what it computes.
NAMING_ATTRS = ("global_symbol", "dietserve.workload", "dietserve.plan")


def workload_key(func: tirx.PrimFunc) -> str:
    """The operator's identity, from its structure alone: the same for every layer's copy and
    every model that has it, whatever the function is named or tagged."""
    import tvm_ffi

    normalized = func
    for attr in NAMING_ATTRS:
        if normalized.attrs is not None and attr in normalized.attrs:
            normalized = normalized.without_attr(attr)
    return f"{tvm_ffi.structural_hash(normalized) & 0xFFFFFFFFFFFFFFFF:016x}"


# -- shape expressions as text ---------------------------------------------------------------

_BINARY = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//", tirx.FloorMod: "%"}


def expr_text(expr) -> str:
    """A shape expression (vars, integers, + - * // %) as Python-readable text."""
    if isinstance(expr, tirx.IntImm):
        return str(int(expr))
    if isinstance(expr, tirx.Var):
        return expr.name
    for kind, symbol in _BINARY.items():
        if isinstance(expr, kind):
            parts = [expr_text(operand) for operand in (expr.a, expr.b)]
            parts = [f"({p})" if " " in p else p for p in parts]
            return f"{parts[0]} {symbol} {parts[1]}"
    raise ValueError(f"shape expression {expr} uses an operation shape text cannot hold")


def evaluate(expr, shape: Mapping[str, int]) -> int:
    """A TIR shape expression's value for concrete var values."""
    value = evaluate_text(expr_text(expr), shape)
    return int(value)


def flops(func: tirx.PrimFunc, shape: Mapping[str, int]) -> int:
    return 2 * math.prod(evaluate(extent, shape) for extent in matmul_extents(func))
