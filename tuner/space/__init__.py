"""Micro-kernel search space: built from hardware limits, not from any one shape."""

from dietserve.kernels.cpu_packed import packed_tile
from dietserve.kernels.hardware import CPU_PRESETS, GPU_PRESETS, CpuHardware, GpuHardware, detect_cpu
from dietserve.kernels.microkernel import MicroKernel
from dietserve.kernels.packing import weight_param


def task_space(space: list[MicroKernel], func) -> list[MicroKernel]:
    """The kernels of ``space`` that fit the operator ``func``: the packed-weight kernels whose
    task width divides its weight's columns when it has a weight and some fit (packing first),
    else the kernels that read operands as they are."""
    weight = weight_param(func)
    packed = []
    if weight is not None:
        columns = weight[2]
        packed = [k for k in space if k.pack and columns % (k.pack * packed_tile(k)[3]) == 0]
    return packed or [k for k in space if not k.pack]


__all__ = ["CPU_PRESETS", "GPU_PRESETS", "CpuHardware", "GpuHardware", "MicroKernel", "detect_cpu", "task_space"]
