"""Apply a micro-kernel to a matmul-like PrimFunc: CPU (llvm) or CUDA."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tvm import tirx

from ..space.microkernel import MicroKernel
from .common import ScheduleMismatch, find_matmul
from .cpu import apply_cpu

ApplyFn = Callable[..., tirx.PrimFunc]


def apply_kernel(func: tirx.PrimFunc, kernel: MicroKernel, target_kind: str, loop_partition: bool = False):
    if target_kind == "cuda":
        from .cuda import apply_cuda

        return apply_cuda(func, kernel, loop_partition=loop_partition)
    if target_kind == "llvm":
        return apply_cpu(func, kernel, loop_partition=loop_partition)
    raise ValueError(f"no micro-kernel schedules for target kind {target_kind!r} (llvm or cuda)")


def resolve(path: str) -> ApplyFn:
    """``"package.module:function"`` -> the function (custom schedule applicators)."""
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"schedule function must look like 'package.module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


DEFAULT_APPLY = "tuner.schedule:apply_kernel"

__all__ = ["DEFAULT_APPLY", "ScheduleMismatch", "apply_cpu", "apply_kernel", "find_matmul", "resolve"]
