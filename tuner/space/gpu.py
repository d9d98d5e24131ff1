"""The CUDA micro-kernel space: every kernel a GPU's limits allow, independent of any shape.

A CUDA micro-kernel (see ``tuner/schedule/cuda.py`` for how it is applied) is encoded as

    tile = (("i", (tm, ty)), ("j", (tn, tx)), ("k", (bk,)))

``tm x tn`` is one thread's register tile, ``ty x tx`` the thread grid of a block, so a block
computes a ``bm x bn = (tm * ty) x (tn * tx)`` output tile, stepping through the reduction ``bk``
at a time with both operand tiles staged in shared memory. ``vector`` is the width of the
shared-memory fill's global loads, ``unroll`` the auto-unroll limit (0 leaves it to nvcc),
``cache_scopes`` = (operand scope, accumulator scope).

The rules, each from the hardware description alone (fp32 operands):

* threads: ``ty * tx`` is a whole number of warps and at most ``max_threads_per_block``; ``tx`` is
  8, 16 or 32 so a warp spans whole rows of the thread grid and its stores cover whole 32-byte
  sectors.
* register tile: ``tm, tn`` in 1..8 (powers of two) with ``tm * tn >= tm + tn``: at least one FMA per
  shared-memory load, since shared-memory bandwidth is a fraction of FMA throughput.
* registers: accumulators ``tm * tn`` + operand fragments ``tm + tn`` + 16 for addresses and
  counters must fit ``registers_per_thread``, and two blocks' worth must fit
  ``registers_per_block`` (two resident blocks hide one block's fill behind the other's FMAs).
* shared memory: ``4 * bk * (bm + bn)`` bytes, two blocks' worth within
  ``max_shared_memory_per_block``; above CUDA's 48 KiB static limit the tiles use dynamically
  sized shared memory (scope "shared.dyn", which the runtime opts in to).
* fill: ``vector`` (1, 2, 4) divides ``bk`` and ``bn`` (both operand tiles' rows) and every thread
  loads the same number of whole vectors of each tile.
* ``bk`` in 8, 16, 32; ``unroll`` in 0, 64.
"""

from __future__ import annotations

from itertools import product

from dietserve.host.hardware import GpuHardware
from dietserve.kernels.plan.microkernel import MicroKernel

__all__ = ["STATIC_SHARED_MEMORY_BYTES", "gpu_space", "registers_per_thread", "shared_memory_bytes", "threads"]

STATIC_SHARED_MEMORY_BYTES = 48 * 1024  # CUDA's limit for statically sized __shared__ arrays
REGISTER_OVERHEAD = 16  # addresses, loop counters, the thread's indices
REGISTER_TILES = (1, 2, 4, 8)
ROW_THREADS = (8, 16, 32)
REDUCTION_STEPS = (8, 16, 32)
VECTOR_WIDTHS = (1, 2, 4)
UNROLL_STEPS = (0, 64)
BYTES_PER_ELEMENT = 4  # fp32


def threads(kernel: MicroKernel) -> int:
    return kernel.tile_sizes("i")[1] * kernel.tile_sizes("j")[1]


def shared_memory_bytes(kernel: MicroKernel) -> int:
    """Both operand tiles of one reduction step: ``bm x bk`` and ``bk x bn``."""
    return BYTES_PER_ELEMENT * kernel.tile_of("k") * (kernel.tile_of("i") + kernel.tile_of("j"))


def registers_per_thread(kernel: MicroKernel) -> int:
    """An estimate: accumulators, one column/row of operand fragments, fixed overhead."""
    tm, tn = kernel.tile_sizes("i")[0], kernel.tile_sizes("j")[0]
    return tm * tn + tm + tn + REGISTER_OVERHEAD


def _thread_grids(hw: GpuHardware):
    count = hw.warp_size
    while count <= hw.max_threads_per_block:
        for tx in ROW_THREADS:
            if count % tx == 0:
                yield count // tx, tx
        count += hw.warp_size


def _balanced_fill(rows: int, cols: int, block_threads: int, vector: int) -> bool:
    return cols % vector == 0 and (rows * cols) % (block_threads * vector) == 0


def gpu_space(hw: GpuHardware) -> list[MicroKernel]:
    """Every micro-kernel ``hw`` can run under the rules above, in a stable order."""
    kernels = []
    for (ty, tx), tm, tn in product(_thread_grids(hw), REGISTER_TILES, REGISTER_TILES):
        block_threads = ty * tx
        registers = tm * tn + tm + tn + REGISTER_OVERHEAD
        if tm * tn < tm + tn or registers > hw.registers_per_thread:
            continue
        if 2 * registers * block_threads > hw.registers_per_block:
            continue
        bm, bn = tm * ty, tn * tx
        for bk, vector, unroll in product(REDUCTION_STEPS, VECTOR_WIDTHS, UNROLL_STEPS):
            shared = BYTES_PER_ELEMENT * bk * (bm + bn)
            if 2 * shared > hw.max_shared_memory_per_block:
                continue
            if not (_balanced_fill(bm, bk, block_threads, vector) and _balanced_fill(bk, bn, block_threads, vector)):
                continue
            scope = "shared.dyn" if shared > STATIC_SHARED_MEMORY_BYTES else "shared"
            kernels.append(MicroKernel(tile=(("i", (tm, ty)), ("j", (tn, tx)), ("k", (bk,))), unroll=unroll,
                                       vector=vector, cache_scopes=(scope, "local")))
    return kernels
