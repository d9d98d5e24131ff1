"""Building kernels: TVM's TIR lowering, less the buffer compaction our emitted kernels do not need.

The packed and clamped CPU kernels (``cpu_packed/``, ``cpu_clamped/``) are written out with
the IR builder, every buffer they allocate already at its exact size. TVM's default lowering
still runs ``CompactBufferAllocation`` on them, which bounds every access to every allocated
buffer under every enclosing condition: the register tile's accumulators are read and written
hundreds of times a reduction step, under the remainder tiles' branches, so it costs much of a
build and changes nothing in the code. The packed kernels also index their register tiles with
vectors (``Tile.panel_vectors``), which that compaction cannot bound at all: TVM's own
pipeline fails on them.

Such functions carry ``EXACT_BUFFERS``; ``TIR_PIPELINE`` is TVM's default (S-TIR) pipeline in
which compaction skips them and runs on every other function as before (the default rule's
kernels allocate block buffers compaction must shrink).

StorageRewrite, which lets buffers whose lives do not overlap share memory, also skips the
packed kernels (``OWN_STORAGE``): it can merge a row of a tile's accumulators with a remainder
tile's sums, which a loop indexes, and LLVM then stores that row's vectors every reduction
step. Their buffers are stack allocas, which LLVM's own stack colouring overlaps. The clamped
kernels keep it: their tiles run slower without it. ``build`` compiles with this pipeline; the
model's build passes the same name (``compile/pipeline.py``).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.pipeline import finalize_device_passes, finalize_host_passes
from tvm.tirx import compilation_pipeline

EXACT_BUFFERS = "dietserve.exact_buffers"
OWN_STORAGE = "dietserve.own_storage"
TIR_PIPELINE = "dietserve"


def has_exact_buffers(func) -> bool:
    return isinstance(func, tirx.PrimFunc) and func.attrs is not None and bool(func.attrs.get(EXACT_BUFFERS, False))


def has_own_storage(func) -> bool:
    """Whether ``func`` keeps its buffers as allocated: no StorageRewrite (``OWN_STORAGE``)."""
    return has_exact_buffers(func) and bool(func.attrs.get(OWN_STORAGE, False))


def with_exact_buffers(func: tirx.PrimFunc, own_storage: bool = False) -> tirx.PrimFunc:
    """``func`` marked as allocating only exactly sized buffers: no compaction (``TIR_PIPELINE``);
    ``own_storage``: and no StorageRewrite either (its buffers stay as allocated)."""
    func = func.with_attr(EXACT_BUFFERS, True)
    return func.with_attr(OWN_STORAGE, True) if own_storage else func


def _except(transform: tvm.transform.Pass, name: str, skipped) -> tvm.transform.Pass:
    """``transform`` on every PrimFunc of a module except those ``skipped`` says."""

    @tvm.transform.module_pass(opt_level=0, name=name)
    def apply(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        others = {gv: func for gv, func in mod.functions_items()
                  if isinstance(func, tirx.PrimFunc) and not skipped(func)}
        if not others:
            return mod
        transformed = transform(tvm.IRModule(others))
        updated = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in transformed.functions_items():
            updated[gv] = func
        return updated

    return apply


_compact_unless_exact = _except(s_tir.transform.CompactBufferAllocation(),
                                "dietserve.CompactBufferAllocationUnlessExact", has_exact_buffers)
_storage_rewrite_unless_own = _except(tirx.transform.StorageRewrite(), "dietserve.StorageRewriteUnlessOwn",
                                      has_own_storage)


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
            passes.append(_storage_rewrite_unless_own)
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


__all__ = ["EXACT_BUFFERS", "OWN_STORAGE", "TIR_PIPELINE", "build", "has_exact_buffers", "has_own_storage",
           "with_exact_buffers"]
