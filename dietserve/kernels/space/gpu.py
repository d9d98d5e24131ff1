"""The CUDA micro-kernel space: every kernel a GPU's limits allow, independent of any shape.

``tile = (("i", (tm, ty)), ("j", (tn, tx)), ("k", (bk,)))``: a ``tm x tn`` register tile per thread,
a ``ty x tx`` thread grid per block, the reduction ``bk`` at a time with both operand tiles in
shared memory; ``vector`` is the fill's load width, ``unroll`` the auto-unroll limit (0: nvcc's).
Rules (fp32; the tensor-core kernels, fp16 inputs, are ``gpu_tensor_core.py``'s):
* threads: whole warps, at most ``max_threads_per_block``; ``tx`` in 8, 16, 32 so a warp's stores
  cover whole 32-byte sectors.
* ``tm * tn >= tm + tn``: at least one FMA per shared-memory load.
* registers and shared memory: two blocks' worth fit, so one block's fill hides behind the
  other's FMAs; tiles over CUDA's 48 KiB static limit use "shared.dyn".
* fill: ``vector`` divides both operand tiles' rows and every thread loads as many vectors.
"""

from __future__ import annotations

from itertools import product

from ...host.hardware import GpuHardware
from ..plan.microkernel import MicroKernel

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
    """Every micro-kernel ``hw`` can run under the rules above, in a stable order, then the
    tensor-core kernels where it has them (``gpu_tensor_core.py``)."""
    from .gpu_tensor_core import tensor_core_space

    kernels = []
    for (ty, tx), tm, tn in product(_thread_grids(hw), REGISTER_TILES, REGISTER_TILES):
        block_threads, bm, bn = ty * tx, tm * ty, tn * tx
        registers = tm * tn + tm + tn + REGISTER_OVERHEAD
        if tm * tn < tm + tn or registers > min(hw.registers_per_thread, hw.registers_per_block / (2 * block_threads)):
            continue
        for bk, vector, unroll in product(REDUCTION_STEPS, VECTOR_WIDTHS, UNROLL_STEPS):
            shared = BYTES_PER_ELEMENT * bk * (bm + bn)
            fill = _balanced_fill(bm, bk, block_threads, vector) and _balanced_fill(bk, bn, block_threads, vector)
            if 2 * shared > hw.max_shared_memory_per_block or not fill:
                continue
            scope = "shared.dyn" if shared > STATIC_SHARED_MEMORY_BYTES else "shared"
            kernels.append(MicroKernel(tile=(("i", (tm, ty)), ("j", (tn, tx)), ("k", (bk,))), unroll=unroll,
                                       vector=vector, cache_scopes=(scope, "local")))
    return kernels + tensor_core_space(hw)
