"""The hardware limits a micro-kernel must fit: data, printable, hashable, overridable.

CPU limits are detected from the machine (vector width from its instruction sets, cache sizes
from sysfs, cores from the process's CPU set); GPU limits come from named presets, since the
tuner often runs where the GPU is not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from .cpu import AMX_FLAGS


@dataclass(frozen=True)
class CpuHardware:
    name: str
    vector_bits: int  # widest SIMD register: 256 (AVX2), 512 (AVX-512)
    vector_registers: int  # architectural SIMD registers: 16 (AVX2), 32 (AVX-512)
    l1_bytes: int  # per core, data
    l2_bytes: int  # per core
    cores: int
    matrix_tiles: bool = False  # AMX-BF16 tile registers (``cpu_packed/amx.py``)

    def __post_init__(self) -> None:
        for field_name in ("vector_bits", "vector_registers", "l1_bytes", "l2_bytes", "cores"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{field_name} must be positive, got {getattr(self, field_name)}")

    def lanes(self, dtype_bits: int = 32) -> int:
        return self.vector_bits // dtype_bits

    def with_overrides(self, **changes: int | str) -> CpuHardware:
        return replace(self, **changes)


@dataclass(frozen=True)
class GpuHardware:
    name: str
    arch: str  # e.g. "sm_90"
    sm_count: int
    warp_size: int
    max_threads_per_block: int
    max_shared_memory_per_block: int  # bytes, opt-in maximum
    registers_per_block: int  # 32-bit registers
    registers_per_thread: int  # the compiler's cap

    def __post_init__(self) -> None:
        if not (self.arch.startswith("sm_") and self.arch[3:].isdigit()):
            raise ValueError(f"arch must look like sm_90, got {self.arch!r}")

    @property
    def compute_capability(self) -> int:
        """The arch's number: 90 for sm_90 (what decides the instructions a kernel may use)."""
        return int(self.arch[3:])

    def with_overrides(self, **changes: int | str) -> GpuHardware:
        return replace(self, **changes)


GPU_PRESETS = {
    "a100": GpuHardware("NVIDIA A100 SXM", "sm_80", sm_count=108, warp_size=32, max_threads_per_block=1024,
                        max_shared_memory_per_block=163 * 1024, registers_per_block=65536,
                        registers_per_thread=255),
    "h100": GpuHardware("NVIDIA H100 SXM", "sm_90", sm_count=132, warp_size=32, max_threads_per_block=1024,
                        max_shared_memory_per_block=227 * 1024, registers_per_block=65536,
                        registers_per_thread=255),
    "t4": GpuHardware("NVIDIA T4", "sm_75", sm_count=40, warp_size=32, max_threads_per_block=1024,
                      max_shared_memory_per_block=64 * 1024, registers_per_block=65536, registers_per_thread=255),
}

CPU_PRESETS = {
    "avx2": CpuHardware("x86-64 AVX2", vector_bits=256, vector_registers=16, l1_bytes=32 * 1024,
                        l2_bytes=512 * 1024, cores=2),
    "avx512": CpuHardware("x86-64 AVX-512", vector_bits=512, vector_registers=32, l1_bytes=48 * 1024,
                          l2_bytes=2 * 1024 * 1024, cores=2),
}

_SIZE_SUFFIX = {"K": 1024, "M": 1024 * 1024}


def _parse_size(text: str) -> int:
    text = text.strip()
    if text and text[-1] in _SIZE_SUFFIX:
        return int(text[:-1]) * _SIZE_SUFFIX[text[-1]]
    return int(text)


def _cache_size(level: int, kind: str, sysfs: Path) -> int | None:
    for index in sorted(sysfs.glob("cpu0/cache/index*")):
        try:
            if int((index / "level").read_text()) == level and (index / "type").read_text().strip() in kind:
                return _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return None


def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """The largest cache this machine describes (L3, else L2), shared or not; None if unknown."""
    return _cache_size(3, ("Unified",), sysfs) or _cache_size(2, ("Unified", "Data"), sysfs)


def detect_cpu(cpu_flags: set[str], sysfs: Path = Path("/sys/devices/system/cpu")) -> CpuHardware:
    """This machine's limits, from its /proc/cpuinfo flags and the sysfs cache description."""
    base = CPU_PRESETS["avx512" if "avx512f" in cpu_flags else "avx2"]
    if "avx2" not in cpu_flags and "avx512f" not in cpu_flags:
        base = CpuHardware("x86-64 SSE", vector_bits=128, vector_registers=16, l1_bytes=32 * 1024,
                           l2_bytes=256 * 1024, cores=1)
    return replace(
        base,
        name=f"{base.name} (detected)",
        l1_bytes=_cache_size(1, ("Data",), sysfs) or base.l1_bytes,
        l2_bytes=_cache_size(2, ("Unified", "Data"), sysfs) or base.l2_bytes,
        cores=len(os.sched_getaffinity(0)),
        matrix_tiles=AMX_FLAGS <= cpu_flags,
    )
