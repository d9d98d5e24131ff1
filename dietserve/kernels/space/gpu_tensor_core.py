"""The tensor-core micro-kernel space (``dietserve/kernels/cuda/tensor_core.py``): every WMMA
kernel a GPU's limits allow, independent of any shape.

``tile = (("i", (16, fm, wy)), ("j", (16, fn, wx)), ("k", (16, fk)))``: ``wy x wx`` warps per
block, each accumulating ``fm x fn`` 16x16 fp32 fragments, the reduction 16 fk at a time with
both operand tiles in shared memory as fp16. Rules:
* GPUs of compute capability 8.0 or later: WMMA fp16 exists from 7.0, but these kernels are
  compiled and checked for sm_80 and sm_90 only.
* threads: ``32 wy wx``, at most ``max_threads_per_block``.
* registers (an estimate): 8 per accumulator fragment, 4 per operand fragment, the pipeline's
  staged fill and a fixed overhead; two blocks' worth fit, as for the CUDA-core kernels.
* shared memory: the padded fp16 operand tiles, static ("shared", at most 48 KiB), and the padded
  fp32 result tile, dynamic ("shared.dyn": a scope apart, see ``tensor_core.py``); two blocks'
  worth of both fit.
* fill: every thread converts as many whole vectors of ``VECTOR`` elements.
"""

from __future__ import annotations

from itertools import product

from ...host.hardware import GpuHardware
from ..plan.microkernel import MMA_FRAGMENT, MicroKernel
from .gpu import STATIC_SHARED_MEMORY_BYTES

MIN_COMPUTE_CAPABILITY = 80
MMA_KIND = "wmma_f16"
WARP_GRID = (1, 2, 4)  # warps along i and along j
FRAGMENTS = (1, 2, 4)  # 16x16 fragments per warp along i and along j
REDUCTION_FRAGMENTS = (1, 2, 4)  # 16-deep fragments per shared-memory step
VECTOR = 4
REGISTER_OVERHEAD = 32  # addresses, loop counters, fragment indices
OPERAND_ROW_PAD, RESULT_ROW_PAD = 8, 4  # elements, as tensor_core.py pads shared rows


SCOPES = ("shared", "shared.dyn")  # operand tiles, result tile


def tensor_core_kernel(fm: int, wy: int, fn: int, wx: int, fk: int) -> MicroKernel:
    f = MMA_FRAGMENT
    return MicroKernel(tile=(("i", (f, fm, wy)), ("j", (f, fn, wx)), ("k", (f, fk))), vector=VECTOR,
                       cache_scopes=SCOPES, mma=MMA_KIND)


def warps(kernel: MicroKernel) -> int:
    return kernel.tile_sizes("i")[2] * kernel.tile_sizes("j")[2]


def operand_bytes(kernel: MicroKernel) -> int:
    """The fp16 ``bm x bk`` and ``bk x bn`` operand tiles, rows padded."""
    bm, bn, bk = (kernel.tile_of(axis) for axis in ("i", "j", "k"))
    return 2 * (bm * (bk + OPERAND_ROW_PAD) + bk * (bn + OPERAND_ROW_PAD))


def shared_memory_bytes(kernel: MicroKernel) -> int:
    """The operand tiles and the fp32 ``bm x bn`` result tile, rows padded."""
    bm, bn = kernel.tile_of("i"), kernel.tile_of("j")
    return operand_bytes(kernel) + 4 * bm * (bn + RESULT_ROW_PAD)


def registers_per_thread(kernel: MicroKernel, warp_size: int = 32) -> int:
    (_, fm, _), (_, fn, _) = kernel.tile_sizes("i"), kernel.tile_sizes("j")
    bm, bn, bk = (kernel.tile_of(axis) for axis in ("i", "j", "k"))
    staged = (bm * bk + bk * bn) // (2 * warps(kernel) * warp_size)  # fp16 pairs held between steps
    return 8 * fm * fn + 4 * (fm + fn) + staged + REGISTER_OVERHEAD


def tensor_core_space(hw: GpuHardware) -> list[MicroKernel]:
    """Every tensor-core kernel ``hw`` can run under the rules above; none below sm_80."""
    if hw.compute_capability < MIN_COMPUTE_CAPABILITY:
        return []
    kernels = []
    for wy, wx, fm, fn, fk in product(WARP_GRID, WARP_GRID, FRAGMENTS, FRAGMENTS, REDUCTION_FRAGMENTS):
        kernel = tensor_core_kernel(fm, wy, fn, wx, fk)
        threads = warps(kernel) * hw.warp_size
        bm, bn, bk = (kernel.tile_of(axis) for axis in ("i", "j", "k"))
        registers = registers_per_thread(kernel, hw.warp_size)
        shared = shared_memory_bytes(kernel)
        if (threads > hw.max_threads_per_block or 2 * shared > hw.max_shared_memory_per_block
                or operand_bytes(kernel) > STATIC_SHARED_MEMORY_BYTES
                or registers > min(hw.registers_per_thread, hw.registers_per_block / (2 * threads))
                or (bm * bk) % (threads * VECTOR) or (bk * bn) % (threads * VECTOR)):
            continue
        kernels.append(kernel)
    return kernels
