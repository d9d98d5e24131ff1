"""The CPU micro-kernel spaces, from the register file and caches (never from a shape).

Three spaces. Operators with a constant weight (dense layers) get the packed-weight GEMM kernels
(``packed_cpu_space``, ``dietserve/kernels/cpu_packed/kernel.py``): the packing is chosen first (the
panel width, from the vector width) and every kernel of a plan shares it. Operators without
one (attention's batched products, symbolic in both output axes) get the clamped-tile kernels
(``clamped_cpu_space``, ``dietserve/kernels/cpu_clamped/kernel.py``), which need no padding, and the
locally padded kernels (``cpu_space``):

A CPU micro-kernel computes an ``mr x nr`` register tile (``nr`` a whole number of vectors)
over the full reduction, ``ti x tj`` such tiles per parallel task (the cache tile, whose packed
operands and local accumulator must sit in L2), with the reduction padded to multiples of
``kc`` where it is symbolic. Rules:
- registers: ``mr * nr/lanes`` accumulators + ``nr/lanes`` B vectors + 1 broadcast <= registers;
- L1: one B panel row block (``nr`` floats x 256 reduction steps) <= L1;
- L2: the cache tile's local accumulator ``mc x nc`` and a 256-deep B panel <= L2 / 2;
- threads: tiles spread over every core, or run serially (for shapes too small to pay for
  waking the other cores).
"""

from __future__ import annotations

import itertools

from dietserve.host.hardware import CpuHardware
from dietserve.kernels.cpu_clamped.kernel import CLAMPED, PANEL
from dietserve.kernels.cpu_packed.kernel import packed_tile
from dietserve.kernels.cpu_packed.tile import register_footprint
from dietserve.kernels.plan.microkernel import MicroKernel

DTYPE_BYTES = 4
PANEL_DEPTH = 256  # reduction steps a packed panel is sized for
# The depth the space's L2 rule sizes whole-reduction tasks for (a hidden size); a deeper weight
# keeps only the tasks whose panels fit at its own depth (``task_space``, ``whole_task_fits_l2``).
PACKED_PANEL_DEPTH = 768
# Of the L2, what a whole-reduction task of several rows may take at its weight's own depth
# (``whole_task_fits_l2``); the space is sized with 3/4 (blocked tasks keep that).
WHOLE_TASK_L2_SHARE = 1 / 2
# Reduction blocks of the packed kernels: 1 = the whole reduction per register tile; else
# kc-deep blocks of the task's panels stay in L2 while every row tile passes over them (for
# weights too deep for L2: BERT's 3072 -> 768 layer).
REDUCTION_BLOCKS = (1, 256, 384, 768)
# Clamped-tile tasks: (row tiles per task, staging): B read in place, or copied per task.
CLAMPED_TASKS = ((1, (CLAMPED,)), (8, (CLAMPED,)), (8, (CLAMPED, PANEL)), (32, (CLAMPED, PANEL)))


def cpu_space(hw: CpuHardware) -> list[MicroKernel]:
    lanes = hw.lanes(8 * DTYPE_BYTES)
    kernels = []
    for vectors in (1, 2, 3, 4):
        nr = vectors * lanes
        if nr * PANEL_DEPTH * DTYPE_BYTES > hw.l1_bytes:
            continue
        for mr in range(1, 17):
            if mr * vectors + vectors + 1 > hw.vector_registers:
                break
            for ti, tj, kc, pack_b, threads in itertools.product(
                (1, 2, 4, 8, 16), (1, 2, 4, 8), (1, 8, 32), (False, True), (0, 1) if hw.cores > 1 else (0,)
            ):
                mc, nc = mr * ti, nr * tj
                footprint = (mc * nc + PANEL_DEPTH * nc) * DTYPE_BYTES
                if footprint > hw.l2_bytes // 2:
                    continue
                kernels.append(MicroKernel(
                    tile=(("i", (mr, ti)), ("j", (nr, tj)), ("k", (kc,))),
                    vector=lanes,
                    cache_scopes=("local", "B.local") if pack_b else ("local",),
                    threads=threads,
                ))
    return kernels


def packed_cpu_space(hw: CpuHardware) -> list[MicroKernel]:
    """Packed-weight GEMM kernels. Rules, from the hardware:
    - panel ``P`` = 2 or 3 vectors (the B panel a register tile row streams);
    - register tile ``mr x pk*P``: ``mr * v`` accumulators + the B vectors held (``v`` when a
      row reuses them, 1 when ``mr = 1``) + 1 broadcast <= registers, ``v = pk*P / lanes``;
      ``mr = 1`` with wide tiles is the small-T regime (weight streaming, panels split across
      cores); tall tiles are the large-T regime (2-D tiles over T x N);
    - a task's panels (``nb`` of them, ``PACKED_PANEL_DEPTH`` deep, or ``kc`` deep when the
      reduction is blocked) fit in 3/4 of L2, so they stay cached while the task runs down all
      its row tiles (``task_space`` then drops the whole-reduction tasks too big at a deeper
      weight's own depth: ``whole_task_fits_l2``);
    - threads: every core, or serial for shapes too small to wake the others.
    """
    lanes = hw.lanes(8 * DTYPE_BYTES)
    kernels = []
    for panel_vectors, pk in itertools.product((2, 3), (1, 2, 4)):
        panel = panel_vectors * lanes
        vectors = pk * panel_vectors
        for mr in range(1, 17):
            if register_footprint(mr, vectors) > hw.vector_registers:
                break
            for groups, kc, threads in itertools.product((1, 2, 4, 8), REDUCTION_BLOCKS,
                                                         (0, 1) if hw.cores > 1 else (0,)):
                if not _task_fits_l2(panel, pk * groups, PACKED_PANEL_DEPTH if kc == 1 else kc, hw):
                    continue
                kernels.append(MicroKernel(
                    tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))),
                    vector=lanes, threads=threads, pack=panel,
                ))
    return kernels


def _task_fits_l2(panel: int, panels: int, depth: int, hw: CpuHardware, share: float = 3 / 4) -> bool:
    """A task's ``panels`` weight panels, ``depth`` reduction steps deep, in ``share`` of L2."""
    return panels * panel * depth * DTYPE_BYTES <= hw.l2_bytes * share


def whole_task_fits_l2(kernel: MicroKernel, depth: int, hw: CpuHardware) -> bool:
    """Whether ``kernel``'s task block stays in L2 for a weight ``depth`` deep while its row tiles
    pass over it: always for a ``kc``-blocked kernel (sized for its block) and for a one-row
    tile (the small-T regime, for the shortest shapes: at T = 1 it passes over its block once,
    whatever its size, so its wide tasks stay candidates there), else its panels at the whole
    depth. ``packed_cpu_space`` sizes whole-reduction tasks for a
    768-deep weight; a task of 8 panels 16 wide over bert-base's 3072 -> 768 layer holds 1.5 MB
    against a 512 KB L2, and its later row passes read back what the first one streamed past
    the L2. Forced kernels of that layer, the weight from DRAM (``cold_weights.py --op
    dense_3072x768 --interleaved --kernel 6,16,1,8,1 --kernel 6,16,1,2,1 --kernel
    6,16,1,8,384``, 7 rounds, 2-core znver3): 2-panel tasks (384 KB) 1.16x, 1.23x, 1.13x the
    8-panel ones at T = 13, 20, 31, 1.03x at 128, 0.98x at 512, where the 8-panel tasks blocked
    384 deep (which the space keeps) ran 0.99x.

    A whole-reduction task of several rows must fit ``WHOLE_TASK_L2_SHARE`` (half) of the L2,
    not the 3/4 the space is sized with: beside it the L2 holds the row tiles' own rows (a 13-row
    tile over 3072: 160 KB) and what the prefetches bring. Forced, interleaved (2-core Emerald
    Rapids, 2 MB L2, ``forced_kernels.py``, 5 rounds): tasks of 1.2-1.5 MB ran 1.01-1.37x slower
    than the same register tile's tasks of 0.6-0.8 MB in 11 of 12 pairs at T = 128 and 512 (6 x 64
    over 3072: 13.26 against 9.65 ms at T = 512; 6 x 48 over 768: 9.76 against 8.06), 0.91x in
    one; tasks of 0.8 MB and 0.4 MB tied (1.00-1.04x)."""
    if not kernel.pack or kernel.tile_sizes("k")[0] != 1:
        return True
    mr, panel, _, panels = packed_tile(kernel)
    return mr == 1 or _task_fits_l2(panel, panels, depth, hw, WHOLE_TASK_L2_SHARE)


def clamped_cpu_space(hw: CpuHardware) -> list[MicroKernel]:
    """Clamped-tile kernels: an ``mr x nr`` register tile (``nr`` = 1 to 6 vectors) over the
    whole reduction, ``mr * v`` accumulators + the ``v`` B vectors a row reuses + 1 broadcast
    <= registers; a task is ``ti`` row tiles of one batch entry, which run over each column
    tile in turn, the B panel read in place or copied once per task into a contiguous buffer
    (``B.local``: worth it when the task has rows enough to reuse it); every core, or serial
    for the smallest shapes."""
    lanes = hw.lanes(8 * DTYPE_BYTES)
    kernels = []
    for vectors in (1, 2, 3, 4, 6):
        for mr in range(1, 17):
            if mr * vectors + vectors + 1 > hw.vector_registers:
                break
            for (ti, scopes), threads in itertools.product(CLAMPED_TASKS, (0, 1) if hw.cores > 1 else (0,)):
                kernels.append(MicroKernel(tile=(("i", (mr, ti)), ("j", (vectors * lanes,)), ("k", (1,))),
                                           vector=lanes, cache_scopes=scopes, threads=threads))
    return kernels
