"""The CPU micro-kernel space, from the register file and caches (never from a shape).

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

from dietserve.kernels.hardware import CpuHardware
from dietserve.kernels.microkernel import MicroKernel

DTYPE_BYTES = 4
PANEL_DEPTH = 256  # reduction steps a packed panel is sized for


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
