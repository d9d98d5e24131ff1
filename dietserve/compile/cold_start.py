"""The cold start's plans (``--plans analytic``): every dynamic operator of the model planned from
the target's hardware model (``kernels/space/analytic.py``), without measuring anything, so that a
model never tuned on its host is built from register tiles sized for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import tvm

from ..host.cpu import target_cores, target_cpu_flags
from ..host.hardware import CpuHardware, detect_cpu
from ..kernels.plan.kernel_plan import KernelPlan
from ..kernels.space.analytic import analytic_plan
from .passes.link_kernels import target_fields
from .target import tvm_version


def target_hardware(target: tvm.target.Target) -> CpuHardware | None:
    """The limits of the CPU an llvm ``target`` names: its instruction sets (vector width and
    registers), this machine's caches, the target's cores. None for a GPU target: its cold start
    is the default rule."""
    if target.kind.name != "llvm":
        return None
    hardware = detect_cpu(target_cpu_flags(target))
    cores = target_cores(target)
    return hardware.with_overrides(cores=cores) if cores else hardware


def analytic_plans(request, cache_dir: Path, target: tvm.target.Target, hardware: CpuHardware,
                   progress: Callable[[str], None] = lambda _m: None) -> list[KernelPlan]:
    """One plan per dynamic operator of ``request``'s model (for ``target``, an llvm one) that
    the CPU kernels fit, priced for ``hardware`` (``target_hardware``)."""
    from .tuning import tuning_tasks  # tuning compiles artifacts itself: imported here, not at the top

    tasks = tuning_tasks(request, cache_dir)
    plans = []
    for task in tasks.tasks:
        plan = analytic_plan(tvm.ir.load_json(task.func), task.operator, task.vary, task.fixed, task.weights,
                             target_fields(target), tvm_version(), hardware, request.precision)
        if plan is not None:
            plans.append(plan)
    progress(f"planned {len(plans)} of {len(tasks.tasks)} dynamic operators from the hardware model "
             f"({hardware.vector_bits}-bit vectors, {hardware.vector_registers} registers, "
             f"L2 {hardware.l2_bytes // 1024} KiB, {hardware.cores} cores)")
    return plans
