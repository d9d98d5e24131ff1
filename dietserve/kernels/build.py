"""Building kernels: TVM's TIR lowering, less the buffer compaction our emitted kernels do not need.

The packed and clamped CPU kernels (``cpu_packed.py``, ``cpu_clamped.py``) are written out with
the IR builder, every buffer they allocate already at its exact size. TVM's default lowering
still runs ``CompactBufferAllocation`` on them, which bounds every access to every allocated
buffer under every enclosing condition: the register tile's accumulators are read and written
hundreds of times a reduction step, under the remainder tiles' branches. On bert-base's dense
layers (znver4, ``tests/benchmarks/build_time.py``, when it could still build them both ways)
builds without it ran 1.14-1.36x faster, and 4.15x for a 13-row tile reading its rows from a
k-major copy (0.61 s, not 2.53), with the same assembly (the one difference in the IR, the row
copy's workspace, had got a 13-deep min/max expression for the size it already had). The packed
kernels now index their register tiles with vectors (``Tile.panel_vectors``), which that
compaction cannot bound at all: TVM's own pipeline fails on them.

Such functions carry ``EXACT_BUFFERS``; ``TIR_PIPELINE`` is TVM's default (S-TIR) pipeline in
which compaction skips them and runs on every other function as before (the default rule's
kernels allocate block buffers compaction must shrink). ``build`` compiles with it; the
model's build passes the same name (``compile/pipeline.py``).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.pipeline import finalize_device_passes, finalize_host_passes
from tvm.tirx import compilation_pipeline

EXACT_BUFFERS = "dietserve.exact_buffers"
TIR_PIPELINE = "dietserve"


def has_exact_buffers(func) -> bool:
    return isinstance(func, tirx.PrimFunc) and func.attrs is not None and bool(func.attrs.get(EXACT_BUFFERS, False))


def with_exact_buffers(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` marked as allocating only exactly sized buffers: no compaction (``TIR_PIPELINE``)."""
    return func.with_attr(EXACT_BUFFERS, True)


@tvm.transform.module_pass(opt_level=0, name="dietserve.CompactBufferAllocationUnlessExact")
def _compact_unless_exact(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    others = {gv: func for gv, func in mod.functions_items()
              if isinstance(func, tirx.PrimFunc) and not has_exact_buffers(func)}
    if not others:
        return mod
    compacted = s_tir.transform.CompactBufferAllocation()(tvm.IRModule(others))
    updated = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    for gv, func in compacted.functions_items():
        updated[gv] = func
    return updated


def _pipeline_factory():
    """TVM 0.27's ``default_s_tir_pipeline`` (``tvm/s_tir/pipeline.py``), pass for pass, with
    ``CompactBufferAllocation`` replaced by ``_compact_unless_exact``. (TVM builds that list
    inside a closure, so it cannot be edited in place.) ``test_build.py`` checks that an
    unmarked function lowers exactly as with the default."""

    @tvm.transform.module_pass(opt_level=0, name="dietserve.TIRPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        config = tvm.transform.PassContext.current().config
        passes = [
            s_tir.transform.CanonicalizeLoop(),
            s_tir.transform.LowerCrossThreadReduction(),
            s_tir.transform.LowerInitBlock(),
            s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
            s_tir.transform.ConvertBlocksToOpaque(),
            s_tir.transform.LiftThreadBinding(),
            s_tir.transform.ManifestSharedMemoryLocalStage(),
            _compact_unless_exact,
            s_tir.transform.LowerAutoCopy(),
            s_tir.transform.UnifyThreadBinding(),
            s_tir.transform.LowerMatchBuffer(),
            s_tir.transform.StmtSimplify(),
            s_tir.transform.InjectPermutedLayout(),
            s_tir.transform.AnnotateIrregularLoop(),
            s_tir.transform.InjectSoftwarePipeline(),
            s_tir.transform.TransformMmaBufferLayout(),
            s_tir.transform.LowerOpaqueBlock(),
            tirx.transform.FlattenBuffer(),
            tirx.transform.BF16ComputeLegalize(),
            tirx.transform.NarrowDataType(32),
            s_tir.transform.LoopPartition(),
            tirx.transform.VectorizeLoop(not bool(config.get("tirx.disable_vectorize", False))),
            s_tir.transform.InjectVirtualThread(),
            s_tir.transform.InjectDoubleBuffer(),
        ]
        if not bool(config.get("tirx.disable_storage_rewrite", False)):
            passes.append(tirx.transform.StorageRewrite())
        if config.get("tirx.use_async_copy", False):
            passes.append(s_tir.transform.LowerAsyncDMA())
        passes += [
            s_tir.transform.HoistIfThenElse(),
            tirx.transform.UnrollLoop(),
            s_tir.transform.RenormalizeSplitPattern(),
            tirx.transform.StmtSimplify(),
            tirx.transform.RemoveNoOp(),
            s_tir.transform.RewriteUnsafeSelect(),
        ]
        if bool(config.get("tirx.instrument_bound_checkers", False)):
            passes.append(s_tir.transform.InstrumentBoundCheckers())
        if bool(config.get("tirx.s_tir.ldg32", False)):
            passes.append(s_tir.transform.InjectPTXLDG32(True))
        if not bool(config.get("tirx.disable_cse_tir", False)):
            passes.append(tirx.transform.CommonSubexprElim())
        if bool(config.get("tirx.instrument_lwp", False)):
            passes.append(s_tir.transform.InstrumentProfileIntrinsics())
        passes += [
            tirx.transform.FP8ComputeLegalize(),
            s_tir.transform.VerifyVTCMLimit(),
            s_tir.transform.LowerVtcmAlloc(),
            tirx.transform.VerifyMemory(),
            tirx.transform.AnnotateEntryFunc(),
            s_tir.transform.ThreadSync("shared"),
            s_tir.transform.ThreadSync("shared.dyn"),
            s_tir.transform.ThreadSync("warp"),
            s_tir.transform.InferFragment(),
            s_tir.transform.LowerThreadAllreduce(),
        ]
        if bool(config.get("tirx.use_async_copy", False)):
            passes.append(s_tir.transform.InjectPTXAsyncCopy())
        if bool(config.get("tirx.s_tir.ldg32", False)):
            passes.append(s_tir.transform.InjectPTXLDG32())
        passes += [
            s_tir.transform.MergeSharedMemoryAllocations(),
            tirx.transform.SplitHostDevice(),
            tirx.transform.MakePackedAPI(),
            tirx.transform.FP8StorageLegalize(),
            tirx.transform.BF16StorageLegalize(),
        ]
        return tvm.transform.Sequential(passes)(mod)

    return _pipeline, finalize_host_passes, finalize_device_passes


compilation_pipeline.register_tir_pipeline(TIR_PIPELINE, _pipeline_factory)


def build(func_or_module, target) -> tvm.runtime.Executable:
    """``tvm.compile`` with ``TIR_PIPELINE``."""
    return tvm.compile(func_or_module, target, tir_pipeline=TIR_PIPELINE)


__all__ = ["EXACT_BUFFERS", "TIR_PIPELINE", "build", "has_exact_buffers", "with_exact_buffers"]
