"""A bound on the VM's buffer pool, measured as this process's resident memory.

The Relax VM's pooled allocator keeps every freed buffer for reuse by a later request of exactly
the same byte size, and never gives one back. Intermediate buffers are planned once for the
artifact's largest shape (``tir_var_upper_bound``), but outputs are sized per request, so under
varied shapes the pool grows by a buffer per distinct size, without a plateau (MiniLM: 0.6 to
1.9 GiB over 600 random shapes). Allocating without a pool (``memory_cfg="naive"``) stays flat
but costs 2-5% per call in page faults. Instead, when resident memory passes a stated limit
after an execution, the pool's free buffers are released (tens of milliseconds, rarely).
"""

from __future__ import annotations

import ctypes
import os
import time

import tvm_ffi

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIN_SECONDS_BETWEEN_RELEASES = 1.0  # if something else holds the memory, do not clear on every call


def release_freed_heap() -> None:
    """Hands the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). glibc returns a freed block of the heap only from its top, and raises its mmap
    threshold as large blocks are freed, so the buffers a one-time step frees (an artifact's
    load: the stored weights, their packing) stay resident: MiniLM's load left 83 MiB of them
    beside its 86 MiB of weights."""
    try:
        # the symbols this process has loaded: the C library's among them (no search for its
        # file, which ``ctypes.util.find_library`` makes by running ldconfig in a subprocess)
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # a C library without malloc_trim (not glibc)
        pass


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE_BYTES


class PoolBound:
    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.releases = 0
        self._release = tvm_ffi.get_global_func("vm.builtin.memory_manager.clear")
        self._last_release = float("-inf")

    def check(self) -> None:
        """Call between executions (never during one: the pool is shared)."""
        if resident_bytes() <= self.limit_bytes:
            return
        now = time.monotonic()
        if now - self._last_release < MIN_SECONDS_BETWEEN_RELEASES:
            return
        self._release()
        self._last_release = now
        self.releases += 1
