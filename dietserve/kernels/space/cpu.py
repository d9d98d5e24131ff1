"""The CPU micro-kernel spaces, from the register file and caches (never from a shape).

Operators with a constant weight (dense layers) get the packed-weight kernels
(``packed_cpu_space``); those without one (attention's batched products) get the clamped-tile
kernels (``clamped_cpu_space``), which need no padding, and the locally padded ones (``cpu_space``).
Every space offers each tile on every core and serial (for shapes too small to wake the others).
"""

from __future__ import annotations

import itertools

from ...host.hardware import CpuHardware
from ..cpu_clamped.kernel import CLAMPED, PANEL
from ..cpu_packed.amx import fits_tile_registers
from ..cpu_packed.kernel import packed_tile
from ..cpu_packed.tile import register_footprint
from ..plan.microkernel import AMX_BF16, AMX_TILE, MicroKernel

DTYPE_BYTES = 4
PANEL_DEPTH = 256  # reduction steps a packed panel is sized for
# The depth whole-reduction packed tasks are sized for (a hidden size): see ``whole_task_fits_l2``.
PACKED_PANEL_DEPTH = 768
# Of the L2, what a whole-reduction task of several rows may take at its weight's own depth.
WHOLE_TASK_L2_SHARE = 1 / 2
# Reduction blocks of the packed kernels: 1 = the whole reduction per register tile; else kc-deep
# blocks of the task's panels stay in L2 while every row tile passes over them (deep weights).
REDUCTION_BLOCKS = (1, 256, 384, 768)
# Clamped-tile tasks: (row tiles per task, staging): B read in place, or copied per task.
CLAMPED_TASKS = ((1, (CLAMPED,)), (8, (CLAMPED,)), (8, (CLAMPED, PANEL)), (32, (CLAMPED, PANEL)))


def _threads(hw: CpuHardware) -> tuple[int, ...]:
    return (0, 1) if hw.cores > 1 else (0,)  # every core, or serial


def cpu_space(hw: CpuHardware) -> list[MicroKernel]:
    """Padded kernels: an ``mr x nr`` register tile over the full reduction, ``ti x tj`` of them per
    task (the cache tile), the reduction padded to ``kc`` where symbolic. Registers: ``mr * v``
    accumulators + ``v`` B vectors + 1 broadcast; L1 holds a 256-deep panel row block; L2 / 2 the
    cache tile's accumulator and a 256-deep B panel."""
    lanes = hw.lanes(8 * DTYPE_BYTES)
    kernels = []
    for vectors in (1, 2, 3, 4):
        nr = vectors * lanes
        if nr * PANEL_DEPTH * DTYPE_BYTES > hw.l1_bytes:
            continue
        for mr in range(1, 17):
            if mr * vectors + vectors + 1 > hw.vector_registers:
                break
            for ti, tj, kc, pack_b, threads in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8), (1, 8, 32),
                                                                 (False, True), _threads(hw)):
                if (mr * ti * nr * tj + PANEL_DEPTH * nr * tj) * DTYPE_BYTES > hw.l2_bytes // 2:
                    continue
                scopes = ("local", "B.local") if pack_b else ("local",)
                kernels.append(MicroKernel(tile=(("i", (mr, ti)), ("j", (nr, tj)), ("k", (kc,))), vector=lanes,
                                           cache_scopes=scopes, threads=threads))
    return kernels


def packed_cpu_space(hw: CpuHardware) -> list[MicroKernel]:
    """Packed-weight kernels: panels of ``P`` = 2 or 3 vectors; a register tile ``mr x pk*P`` whose
    accumulators, held B vectors and a broadcast fit the registers (``mr = 1``: the small-T regime,
    streaming the weight); a task's panels, ``PACKED_PANEL_DEPTH`` or ``kc`` deep, in 3/4 of L2 so
    they stay cached while the task runs down its row tiles."""
    lanes = hw.lanes(8 * DTYPE_BYTES)
    kernels = []
    for panel_vectors, pk in itertools.product((2, 3), (1, 2, 4)):
        panel = panel_vectors * lanes
        vectors = pk * panel_vectors
        for mr in range(1, 17):
            if register_footprint(mr, vectors) > hw.vector_registers:
                break
            for groups, kc, threads in itertools.product((1, 2, 4, 8), REDUCTION_BLOCKS, _threads(hw)):
                if _task_fits_l2(panel, pk * groups, PACKED_PANEL_DEPTH if kc == 1 else kc, hw):
                    kernels.append(MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))),
                                               vector=lanes, threads=threads, pack=panel))
    return kernels + amx_cpu_space(hw)


def amx_cpu_space(hw: CpuHardware) -> list[MicroKernel]:
    """AMX kernels (``cpu_packed/amx.py``), where the CPU has AMX-BF16 tiles: a register tile of
    ``mt`` x ``pk * panel / 16`` C tiles of 16 x 16 sums whose A and B tiles fit the 8 tile
    registers beside them; tasks sized as the packed kernels' (their weights are the same panels,
    bf16 pairs: ``task_space`` offers them to bf16 layers only)."""
    if not hw.matrix_tiles:
        return []
    kernels = []
    for panel, pk, row_tiles in itertools.product((32, 48), (1, 2), (1, 2)):
        if not fits_tile_registers(row_tiles, pk * panel // AMX_TILE):
            continue
        for groups, threads in itertools.product((1, 2, 4, 8), _threads(hw)):
            if _task_fits_l2(panel, pk * groups, PACKED_PANEL_DEPTH, hw):
                kernels.append(MicroKernel(tile=(("i", (row_tiles * AMX_TILE,)), ("j", (panel, pk, groups)),
                                                 ("k", (1,))), vector=AMX_TILE, threads=threads, pack=panel,
                                           mma=AMX_BF16))
    return kernels


def _task_fits_l2(panel: int, panels: int, depth: int, hw: CpuHardware, share: float = 3 / 4) -> bool:
    """A task's ``panels`` weight panels, ``depth`` reduction steps deep, in ``share`` of L2."""
    return panels * panel * depth * DTYPE_BYTES <= hw.l2_bytes * share


def whole_task_fits_l2(kernel: MicroKernel, depth: int, hw: CpuHardware) -> bool:
    """Whether ``kernel``'s task block stays in L2 for a weight ``depth`` deep while its row tiles
    pass over it. Always for a ``kc``-blocked kernel (sized for its block) and a one-row tile (it
    passes over its block once); else its panels at the whole depth must fit
    ``WHOLE_TASK_L2_SHARE`` of the L2, not the space's 3/4: beside them the L2 holds the row tiles'
    own rows and what the prefetches bring, and a later row pass would read back from DRAM what
    the first streamed past the L2 (measured in docs/design/kernels.md)."""
    if not kernel.pack or kernel.tile_sizes("k")[0] != 1:
        return True
    mr, panel, _, panels = packed_tile(kernel)
    return mr == 1 or _task_fits_l2(panel, panels, depth, hw, WHOLE_TASK_L2_SHARE)


def clamped_cpu_space(hw: CpuHardware) -> list[MicroKernel]:
    """Clamped-tile kernels: an ``mr x nr`` register tile (``nr`` = 1 to 6 vectors) over the whole
    reduction; a task is ``ti`` row tiles of one batch entry, its B panel read in place or copied
    once per task (``B.local``: worth it when the task has rows enough to reuse it)."""
    lanes = hw.lanes(8 * DTYPE_BYTES)
    kernels = []
    for vectors in (1, 2, 3, 4, 6):
        for mr in range(1, 17):
            if mr * vectors + vectors + 1 > hw.vector_registers:
                break
            for (ti, scopes), threads in itertools.product(CLAMPED_TASKS, _threads(hw)):
                kernels.append(MicroKernel(tile=(("i", (mr, ti)), ("j", (vectors * lanes,)), ("k", (1,))),
                                           vector=lanes, cache_scopes=scopes, threads=threads))
    return kernels
