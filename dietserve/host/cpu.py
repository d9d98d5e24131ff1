"""This machine's CPU as the kernels see it: its instruction sets and LLVM's name for it.

No compiler needed for the flags (the runtime checks an artifact's required flags with them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# LLVM feature names -> the flag Linux lists in /proc/cpuinfo, for the features a compiled
# kernel may use. Features outside this table are not checked.
LLVM_TO_CPUINFO = {
    "sse4.1": "sse4_1",
    "sse4.2": "sse4_2",
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512cd": "avx512cd",
    "avx512dq": "avx512dq",
    "avx512vl": "avx512vl",
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
    "avx512ifma": "avx512ifma",
    "avx512vbmi": "avx512vbmi",
    "avx512vbmi2": "avx512_vbmi2",
    "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq",
    "amx-tile": "amx_tile",
    "amx-bf16": "amx_bf16",
}


def first_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str] | None:
    """The first CPU's ``name: value`` lines of ``cpuinfo``, None where there is no such file."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # (the next CPU's block)
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The flags of the first CPU, or None where the platform has no /proc/cpuinfo."""
    return _flags(first_cpu(cpuinfo))


def _flags(fields: dict[str, str] | None) -> set[str] | None:
    return set(fields["flags"].split()) if fields and "flags" in fields else None


def target_cpu_flags(target) -> set[str]:
    """The /proc/cpuinfo flags of what an llvm ``target`` (a tvm Target) may use: its ``mcpu``'s
    features as LLVM knows them, within ``LLVM_TO_CPUINFO``."""
    from tvm.target.codegen import llvm_get_cpu_features

    return {LLVM_TO_CPUINFO[name] for name in llvm_get_cpu_features(target) if name in LLVM_TO_CPUINFO}


# The flags of a CPU with AMX tiles that multiply bf16 (``kernels/cpu_packed/amx.py``).
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
# Linux x86-64: arch_prctl's system call number, its request for an extended state's permission,
# and the AMX tile data's state number.
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


def refused_tile_state() -> str | None:
    """Ask Linux for this process's AMX tile state, as every AMX kernel does on each call (the
    request is granted once and stays): None where granted, else why not."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0:
        return None
    return os.strerror(ctypes.get_errno())


def missing_cpu_flags(required: list[str], available: set[str] | None) -> list[str]:
    if available is None:
        return []  # cannot tell; let the load try
    return sorted(flag for flag in required if flag not in available)


# Where a virtual machine hides some features of the CPU LLVM names from its model number (LLVM
# says ``emeraldrapids`` while /proc/cpuinfo lists no ``amx_tile``), code built for that name may
# not run there, and an artifact built for it refuses to load. The host is then built for the
# newest of these (its vendor's, then generic) whose features it has.
OLDER_CPUS = {
    "GenuineIntel": ("graniterapids", "emeraldrapids", "sapphirerapids", "icelake-server", "cascadelake",
                     "skylake-avx512", "broadwell", "haswell"),
    "AuthenticAMD": ("znver5", "znver4", "znver3", "znver2", "znver1"),
}
GENERIC_CPUS = ("x86-64-v4", "x86-64-v3", "x86-64-v2", "x86-64")


def host_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """LLVM's name for this CPU (e.g. ``znver3``), or, where this machine lacks features of the
    CPU of that name (a VM's), the newest CPU LLVM knows whose features it has (``OLDER_CPUS``)."""
    from tvm.target.codegen import llvm_get_system_cpu

    fields = first_cpu(cpuinfo)
    return runnable_cpu(str(llvm_get_system_cpu()), _flags(fields), (fields or {}).get("vendor_id"))


def runnable_cpu(named: str, flags: set[str] | None, vendor: str | None) -> str:
    """``named`` if code built for it runs on a CPU with ``flags`` (/proc/cpuinfo's; None: cannot
    tell), else the first of ``vendor``'s ``OLDER_CPUS``, then ``GENERIC_CPUS``, that does (the
    last, ``x86-64``, needs none of the features checked)."""
    if flags is None:
        return named
    import tvm

    candidates = (named, *OLDER_CPUS.get(vendor or "", ()), *GENERIC_CPUS)
    return next(cpu for cpu in candidates
                if target_cpu_flags(tvm.target.Target({"kind": "llvm", "mcpu": cpu})) <= flags)


def available_cpus() -> list[int]:
    """The CPUs this process may run on (respects taskset / container cpusets)."""
    return sorted(os.sched_getaffinity(0))


def configure_cpu_threads(threads: int | None = None) -> int:
    """Size TVM's CPU thread pool; returns the thread count used.

    TVM's default halves the hardware thread count on x86 (it assumes hyper-threading), which
    leaves half the cores idle where each has one hardware thread (a VM's vCPUs). The workers
    share the allowed CPUs rather than being pinned one per core: pinning would also pin the
    calling thread, and every thread it starts afterwards, to a single core.
    """
    import tvm_ffi

    cpus = available_cpus()
    count = len(cpus) if threads is None else threads
    if count < 1:
        raise ValueError(f"threads must be at least 1, got {count}")
    share_all_cores = -3  # tvm::runtime::threading::ThreadGroup::kSpecifyThreadShareAllCore
    tvm_ffi.get_global_func("runtime.config_threadpool")(share_all_cores, count, [str(c) for c in cpus])
    return count


def target_cores(target) -> int | None:
    """The cores a CPU target's kernels run on (its ``num-cores``), None where it names none or
    is no CPU target. ``target``: a TVM Target or its description as a dict (a manifest's, a
    tuning job's). Here, not beside the schedules, because the engine calls it where only TVM's
    runtime is installed."""
    if isinstance(target, Mapping):
        kind, cores = target.get("kind"), target.get("num-cores")
    else:
        kind, cores = target.kind.name, target.attrs.get("num-cores")
    return int(cores) if kind == "llvm" and cores else None
