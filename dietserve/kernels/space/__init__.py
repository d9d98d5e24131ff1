"""Micro-kernel search space: built from hardware limits, not from any one shape."""

from ...host.hardware import CpuHardware, GpuHardware
from ..cpu_clamped.kernel import clamped_fits, is_clamped
from ..cpu_packed.bf16 import PAIR_LANES, precision_of
from ..cpu_packed.kernel import packed_tile
from ..cpu_packed.packing import weight_param
from ..plan.microkernel import AMX_BF16, MicroKernel
from .cpu import whole_task_fits_l2


def task_space(space: list[MicroKernel], func, hardware: CpuHardware | GpuHardware | None = None) -> list[MicroKernel]:
    """The kernels of ``space`` that fit the operator ``func``: the packed-weight kernels whose
    task width divides its weight's columns in two panels or more, whose reduction block divides
    its depth and (given CPU ``hardware``) whose task stays in L2 there, if any; else the
    clamped-tile kernels, which need no padding, where the operator takes them; else the padded
    kernels. A bf16 operator's
    packed kernels run over pairs of its reduction steps (``cpu_packed/bf16.py``), as deep as
    half its depth, on 16-lane vectors or AMX tiles (``cpu_packed/amx.py``)."""
    weight = weight_param(func)
    packed = []
    if weight is not None:
        _, depth, columns = weight
        if precision_of(func) == "bf16":
            depth //= 2
            space = [k for k in space if k.vector == PAIR_LANES]
        else:  # (AMX tiles multiply bf16 pairs only)
            space = [k for k in space if k.mma != AMX_BF16]
        # (two panels at least: one panel's index is the constant 0, a binding the schedules'
        # normal form refuses; a single panel is the unpacked layout anyway)
        packed = [k for k in space if k.pack and columns % (k.pack * packed_tile(k)[3]) == 0
                  and columns >= 2 * k.pack and _blocks_fit(k.tile_sizes("k")[0], depth)
                  and (not isinstance(hardware, CpuHardware) or whole_task_fits_l2(k, depth, hardware))]
    if packed:
        return packed
    clamped = [k for k in space if is_clamped(k) and clamped_fits(func, k)]
    return clamped or [k for k in space if not k.pack and not is_clamped(k)]


def _blocks_fit(kc: int, depth: int) -> bool:
    """A reduction block that splits the weight's depth into whole blocks (1: not blocked)."""
    return kc == 1 or (kc < depth and depth % kc == 0)

