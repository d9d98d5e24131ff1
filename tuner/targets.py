"""Where tuning runs: the TVM target (as a dict, so it crosses process pipes), the
micro-kernel space for its hardware, and how many cores/SMs f_adapt spreads tiles over."""

from __future__ import annotations

from dataclasses import dataclass

import tvm

from dietserve.host.hardware import GPU_PRESETS, CpuHardware, GpuHardware, detect_cpu
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.cpu import clamped_cpu_space, cpu_space, packed_cpu_space
from dietserve.kernels.space.gpu import gpu_space


@dataclass(frozen=True)
class TuningTarget:
    target: dict
    space: list[MicroKernel]
    cores: int  # CPU cores or GPU SMs
    hardware: CpuHardware | GpuHardware


def resolve_target(kind: str = "llvm", gpu: str = "h100", cores: int | None = None, mcpu: str | None = None,
                   sm_count: int | None = None) -> TuningTarget:
    """``llvm``: this machine's CPU (detected; ``cores``/``mcpu`` override); ``cuda``: a GPU
    preset (``sm_count`` overrides), measured wherever the runner runs."""
    if kind == "cuda":
        if gpu not in GPU_PRESETS:
            raise ValueError(f"unknown GPU preset {gpu!r}; known: {sorted(GPU_PRESETS)}")
        hardware = GPU_PRESETS[gpu].with_overrides(sm_count=sm_count) if sm_count else GPU_PRESETS[gpu]
        target = {"kind": "cuda", "arch": hardware.arch, "host": {"kind": "llvm", "mcpu": "x86-64"}}
        return TuningTarget(target, gpu_space(hardware), hardware.sm_count, hardware)
    if kind != "llvm":
        raise ValueError(f"target must be llvm or cuda, got {kind!r}")
    from dietserve.host.cpu import cpu_flags, host_cpu, target_cpu_flags  # looked up at call time (tests patch it)

    flags = cpu_flags() or set()
    if mcpu:
        # The named CPU's instruction sets, as far as this machine (which times the kernels) has
        # them: an AVX2 target on an AVX-512 host gets register tiles for 16 registers of 8 lanes.
        named = target_cpu_flags(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))
        flags = named & flags if flags else named
    hardware = detect_cpu(flags)
    if cores:
        hardware = hardware.with_overrides(cores=cores)
    target = {"kind": "llvm", "mcpu": mcpu or host_cpu(), "num-cores": hardware.cores}
    space = cpu_space(hardware) + packed_cpu_space(hardware) + clamped_cpu_space(hardware)
    return TuningTarget(target, space, hardware.cores, hardware)
