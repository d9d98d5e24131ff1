"""Schedule a matmul-like PrimFunc with one variant: a micro-kernel (CPU or CUDA), or the
default rule's own kernel (what an untuned build runs), for every value of its symbolic dims."""

from __future__ import annotations

from tvm import tirx
from tvm.target import Target

from ..host.cpu import target_cores
from .cpu_clamped.kernel import apply_cpu_clamped, is_clamped, softmax_after
from .cpu_packed.amx import apply_cpu_amx
from .cpu_packed.kernel import apply_cpu_packed
from .cpu_packed.packing import packed_form
from .cpu_padded.kernel import apply_cpu
from .plan.microkernel import AMX_BF16, MicroKernel
from .settings import KernelSettings, kernel_settings
from .tir.loops import float_lanes
from .tir.matching import ScheduleMismatch


def apply_kernel(func: tirx.PrimFunc, kernel: MicroKernel, target: Target | str,
                 loop_partition: bool = False, settings: KernelSettings | None = None) -> tirx.PrimFunc:
    """``func`` as ``kernel`` for ``target`` (a str: a target kind). The signature of every
    schedule the tuner applies (``TuneOptions.apply``). A CPU target's ``num-cores``: the threads
    that take a packed kernel's tasks at run time; none named: TVM's even split of them
    (``cpu_packed.kernel.apply_cpu_packed``). ``settings``: None, the target's own
    (``kernel_settings``)."""
    target = Target(target) if isinstance(target, str) else target
    settings = settings or kernel_settings(target)
    target_kind = target.kind.name
    if target_kind == "cuda":
        if kernel.mma == AMX_BF16:
            raise ScheduleMismatch(f"an AMX micro-kernel runs on CPU targets only: {kernel}")
        if kernel.mma:
            from .cuda.tensor_core import apply_tensor_core

            return apply_tensor_core(func, kernel, loop_partition=loop_partition)
        from .cuda.kernel import apply_cuda

        return apply_cuda(func, kernel, loop_partition=loop_partition)
    if target_kind == "llvm":
        if kernel.mma == AMX_BF16:
            return apply_cpu_amx(packed_form(func, kernel.pack), kernel, target_cores(target),
                                 settings=settings.packed)
        if kernel.mma:
            raise ScheduleMismatch(f"a tensor-core micro-kernel runs on CUDA targets only: {kernel}")
        if kernel.pack:
            return apply_cpu_packed(packed_form(func, kernel.pack), kernel, target_cores(target),
                                    settings=settings.packed)
        if is_clamped(kernel):
            return apply_cpu_clamped(func, kernel, settings=settings.clamped)
        return apply_cpu(func, kernel, loop_partition=loop_partition)
    raise ValueError(f"no micro-kernel schedules for target kind {target_kind!r} (llvm or cuda)")


def default_rules(target: Target) -> list:
    """The rules an untuned build schedules matmul-like PrimFuncs with, in order."""
    if target.kind.name == "cuda":
        from tvm.s_tir import dlight

        return [dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Reduction(), dlight.gpu.GeneralReduction(),
                dlight.gpu.Fallback()]
    from .cpu_default.rule import CPUMatmul

    return [CPUMatmul()]


def apply_default(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc:
    """The default rule's kernel for ``func``: the untuned build's, always a dispatch candidate."""
    with target:
        for rule in default_rules(target):
            scheduled = rule.apply(func, target, False)
            if scheduled is not None:
                result = scheduled if isinstance(scheduled, tirx.PrimFunc) else scheduled.mod["main"]
                return result.with_attr("tirx.is_scheduled", True)
    raise ScheduleMismatch(f"no default rule schedules this PrimFunc for {target.kind.name}")


def apply_variant(func: tirx.PrimFunc, kernel: MicroKernel | None, target: Target, loop_partition: bool = False,
                  row_softmax: bool = False, settings: KernelSettings | None = None) -> tirx.PrimFunc:
    """``kernel`` None means the default rule's kernel. ``row_softmax`` (CPU): the result is
    then softmaxed over its last axis, in place (attention's scores and softmax as one kernel):
    inside a clamped-tile kernel's tasks, else by a pass after the kernel. ``settings``: None,
    the target's own (``kernel_settings``)."""
    if row_softmax and target.kind.name != "llvm":
        raise ValueError(f"a fused row softmax is built for CPU kernels, not {target.kind.name}")
    settings = settings or kernel_settings(target)
    if row_softmax and kernel is not None and is_clamped(kernel):
        return apply_cpu_clamped(func, kernel, row_softmax=True, settings=settings.clamped)
    scheduled = apply_default(func, target) if kernel is None else \
        apply_kernel(func, kernel, target, loop_partition, settings)
    if row_softmax:
        return softmax_after(scheduled, func, float_lanes(target))
    return scheduled
