"""Our Relax pipeline: a list of small IRModule -> IRModule passes, composed once.

    fast math -> legalize + fuse -> [link tuned kernels] -> default schedules -> lower to the VM

The tuned-kernel linking pass (``passes/link_kernels.py``: the tuner's plans) slots in before
the default schedules, which then leave the PrimFuncs it marked ``tirx.is_scheduled`` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tvm
from tvm import relax
from tvm.s_tir import dlight
from tvm.target import Target

from ..kernels.tir.build import TIR_PIPELINE
from .cpu.serial_when_small import cpu_default_schedule
from .passes import FastSoftmax, VectorGelu, VectorGeluTanh, VectorSilu


def fast_math_passes() -> list[tvm.transform.Pass]:
    """Softmax with TVM's vectorisable exp approximation (libm's expf is scalar, and dominates
    softmax at long sequences), within the 1e-4 budget. GELU keeps the exact erf, evaluated so it vectorises
    (float32, through a rational of the normal tail: closer to the exact GELU than a correctly
    rounded erff in the textbook formula, ``kernels/tir/gelu.py``); TOPI's fast erf's error,
    amplified through the layers, broke that budget (1.3e-4 at seq 300). SiLU and GELU's tanh
    form are ``x * sigmoid(z)`` with the softmax's polynomial exp (their libm calls are scalar too)."""
    return [FastSoftmax(), VectorGelu(), VectorSilu(), VectorGeluTanh()]


def legalize_passes() -> list[tvm.transform.Pass]:
    return [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def default_schedule_pass(target: Target) -> tvm.transform.Pass:
    if target.kind.name == "cuda":
        return dlight.ApplyDefaultSchedule(
            dlight.gpu.Matmul(),
            dlight.gpu.GEMV(),
            dlight.gpu.Reduction(),
            dlight.gpu.GeneralReduction(),
            dlight.gpu.Fallback(),
        )
    return cpu_default_schedule()


def lower_passes(target: Target) -> list[tvm.transform.Pass]:
    passes = [
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
    ]
    if target.kind.name == "cuda":
        passes.append(relax.transform.RewriteCUDAGraph())
    return passes + [
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]


def build_pipeline(
    target: Target,
    link_passes: Sequence[tvm.transform.Pass] = (),
    after_schedule: Sequence[tvm.transform.Pass] = (),
) -> list[tvm.transform.Pass]:
    """The pass list for ``target``; ``link_passes`` replace PrimFuncs with tuned kernels;
    ``after_schedule`` see every PrimFunc scheduled, before VM lowering."""
    return [
        *fast_math_passes(),
        *legalize_passes(),
        *link_passes,
        default_schedule_pass(target),
        *after_schedule,
        *lower_passes(target),
    ]


def schedule_module(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """Legalize, fuse and schedule without lowering: what the tests and tools inspect."""
    with target:
        passes = [*fast_math_passes(), *legalize_passes(), default_schedule_pass(target)]
        return tvm.transform.Sequential(passes)(mod)


def compile_module(
    mod: tvm.IRModule,
    target: Target,
    link_passes: Sequence[tvm.transform.Pass] = (),
    inspect_scheduled: Callable[[tvm.IRModule], None] | None = None,
) -> relax.Executable:
    """``inspect_scheduled`` sees the module after scheduling, before VM lowering."""
    after_schedule = []
    if inspect_scheduled is not None:

        @tvm.transform.module_pass(opt_level=0, name="InspectScheduled")
        def inspect(module: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
            inspect_scheduled(module)
            return module

        after_schedule.append(inspect)
    passes = build_pipeline(target, link_passes, after_schedule)

    @tvm.transform.module_pass(opt_level=0, name="DietservePipeline")
    def pipeline(module: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(module)

    return tvm.compile(mod, target, relax_pipeline=pipeline, tir_pipeline=TIR_PIPELINE)
