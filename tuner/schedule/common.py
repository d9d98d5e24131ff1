"""What the CPU and CUDA micro-kernel schedules share: finding the matmul in a PrimFunc and
padding its iteration space to whole tiles (the first half of local padding)."""

from __future__ import annotations

from collections.abc import Sequence

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func


class ScheduleMismatch(ValueError):
    """The PrimFunc is not a matmul-like operator this micro-kernel can be applied to."""


def static_extent(expr) -> int | None:
    return int(expr) if isinstance(expr, tirx.IntImm) else None


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


def pad_to_tiles(sch: s_tir.Schedule, block, epilogue, tiles: Sequence[int]):
    """Pad the matmul's (i, j, k) to multiples of ``tiles`` where an axis is symbolic or not
    a whole number of tiles. Returns (padded?, the block writing the real output): the
    un-pad copy is folded into the epilogue, or becomes the write-back itself."""
    *batch, i, j, k = sch.get_loops(block)
    padding = []
    for loop, tile in zip((i, j, k), tiles, strict=True):
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


def loops_below(sch: s_tir.Schedule, block, at) -> list:
    """``block``'s loops nested inside loop ``at``."""
    loops = sch.get_loops(block)
    anchor = sch.get(at)
    for depth, loop in enumerate(loops):
        if sch.get(loop).same_as(anchor):
            return list(loops[depth + 1 :])
    return list(loops)
