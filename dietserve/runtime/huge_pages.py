"""The model's weights on transparent huge pages (CPU artifacts, Linux): where the runtime
puts a loaded artifact's weights (and the kernel benchmarks theirs, to read them as served).

A served model reads every weight once per request (bert-base: 340 MB, far more than any
cache), so at short sequences it runs at the rate memory streams them. On 4 KB pages that
stream crosses a page every 4 KB: a TLB miss, and the hardware prefetchers stop at each page
boundary. On 2 MB pages it crosses one every 2 MB.

Linux gives huge pages to memory advised ``MADV_HUGEPAGE`` where transparent huge pages are
``madvise`` or ``always`` (``/sys/kernel/mm/transparent_hugepage/enabled``). Elsewhere, or
where it is ``never``, the arena is ordinary memory: same numbers, same speed as before.
"""

from __future__ import annotations

import mmap

import numpy as np
import tvm

HUGE_PAGE_BYTES = 2 << 20
ALIGNMENT = 4096  # each tensor's offset in the arena (TVM needs 64; a page keeps them apart)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def on_huge_pages(tensors: list) -> list:
    """Copies of CPU ``tensors`` (TVM tensors or numpy arrays) in one anonymous mapping advised
    for huge pages, in order, as TVM tensors.
    The mapping lives as long as any of the returned tensors does (each holds a view of it)."""
    if not tensors:
        return []
    arrays = [np.from_dlpack(tensor) for tensor in tensors]
    size = sum(_aligned(array.nbytes) for array in arrays) + HUGE_PAGE_BYTES
    arena = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # (advice before the first touch: pages come huge)
        arena.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(arena, dtype=np.uint8)
    offset = -raw.ctypes.data % HUGE_PAGE_BYTES  # the arena's start on a huge page boundary
    copies = []
    for array in arrays:
        view = raw[offset: offset + array.nbytes].view(array.dtype).reshape(array.shape)
        view[...] = array
        copies.append(tvm.runtime.from_dlpack(view))
        offset += _aligned(array.nbytes)
    return copies
