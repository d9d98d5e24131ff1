"""Micro-kernel search space: built from hardware limits, not from any one shape."""

from dietserve.kernels.hardware import CPU_PRESETS, GPU_PRESETS, CpuHardware, GpuHardware, detect_cpu
from dietserve.kernels.microkernel import MicroKernel

__all__ = ["CPU_PRESETS", "GPU_PRESETS", "CpuHardware", "GpuHardware", "MicroKernel", "detect_cpu"]
