"""What the machine running an artifact can do: CPU instruction sets and CUDA devices."""

from __future__ import annotations

import os

from ..kernels.host import LLVM_TO_CPUINFO, cpu_flags, missing_cpu_flags

__all__ = ["LLVM_TO_CPUINFO", "available_cpus", "configure_cpu_threads", "cpu_flags", "missing_cpu_flags"]

def available_cpus() -> list[int]:
    """The CPUs this process may run on (respects taskset / container cpusets)."""
    return sorted(os.sched_getaffinity(0))


def configure_cpu_threads(threads: int | None = None) -> int:
    """Size TVM's CPU thread pool; returns the thread count used.

    TVM's default halves the hardware thread count on x86 (it assumes hyper-threading), which
    leaves one of two cores idle on a 2-vCPU machine. The workers share the allowed CPUs rather
    than being pinned one per core: pinning would also pin the calling thread, and every
    thread it starts afterwards, to a single core.
    """
    import tvm_ffi

    cpus = available_cpus()
    count = len(cpus) if threads is None else threads
    if count < 1:
        raise ValueError(f"threads must be at least 1, got {count}")
    share_all_cores = -3  # tvm::runtime::threading::ThreadGroup::kSpecifyThreadShareAllCore
    tvm_ffi.get_global_func("runtime.config_threadpool")(share_all_cores, count, [str(c) for c in cpus])
    return count
