"""The kernels' TIR pipeline (``dietserve/kernels/tir/build.py``): TVM's default lowering, with buffer
compaction skipped only for functions that allocate exactly sized buffers (our emitted packed
and clamped kernels). Checked against TVM's own pipeline and against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from dietserve.kernels.apply import apply_default, apply_kernel
from dietserve.kernels.cpu_packed.packing import pack_array
from dietserve.kernels.decision_tree_func import dispatched_prim_func
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.tir.build import EXACT_BUFFERS, build, has_exact_buffers, has_own_storage
from tuner.ops import dense, random_inputs

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
COMPACTION = "s_tir.CompactBufferAllocation"


def packed(mr: int, panel: int, pk: int, groups: int, kc: int = 1) -> MicroKernel:
    return MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))), vector=16, pack=panel)


@tvm.instrument.pass_instrument
class FunctionsCompacted:
    """The names of the functions each run of TVM's buffer compaction was given."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def run_before_pass(self, mod: tvm.IRModule, info: tvm.transform.PassInfo) -> None:
        if info.name == COMPACTION:
            self.names += [gv.name_hint for gv, _ in mod.functions_items()]


def compacted_names(module: tvm.IRModule, ours: bool, seen: FunctionsCompacted | None = None) -> list[str]:
    """The functions compaction ran on (recorded in ``seen``), building with our pipeline or TVM's own."""
    seen = seen or FunctionsCompacted()
    with tvm.transform.PassContext(opt_level=3, instruments=[seen]):
        build(module, TARGET) if ours else tvm.compile(module, TARGET)
    return seen.names


def test_unmarked_functions_lower_exactly_as_with_tvms_default_pipeline() -> None:
    """The default rule's kernel (block buffers that compaction must shrink): the same code."""
    default_kernel = apply_default(dense(64, 48, "bias_gelu").func, TARGET)
    assert not has_exact_buffers(default_kernel)
    ours, theirs = build(default_kernel, TARGET), tvm.compile(default_kernel, TARGET)
    assert ours.mod.inspect_source("asm") == theirs.mod.inspect_source("asm")


def test_compaction_skips_only_the_marked_functions() -> None:
    spec = dense(64, 48, "bias_gelu")
    exact = apply_kernel(spec.func, packed(4, 16, 1, 1), "llvm")
    assert exact.attrs[EXACT_BUFFERS]
    module = tvm.IRModule({"exact": exact.with_attr("global_symbol", "exact"),
                           "default": apply_default(spec.func, TARGET).with_attr("global_symbol", "default")})
    seen = FunctionsCompacted()
    # TVM's own pipeline gives compaction both, and its region analysis cannot bound the packed
    # kernel's vector indices (``Tile.panel_vectors``)
    with pytest.raises(tvm.error.InternalError):
        compacted_names(module, ours=False, seen=seen)
    assert sorted(seen.names) == ["default", "exact"]
    assert compacted_names(module, ours=True) == ["default"]


def test_a_dispatched_function_is_marked_only_when_every_variant_is() -> None:
    spec = dense(64, 48, "bias_gelu")
    axes = {"b": "1", "i": "T", "j": "48", "k": "64"}

    def plan(variants: dict) -> KernelPlan:
        names = list(variants)
        tree = {"var": "T", "le": 8, "then": {"variant": names[0]}, "else": {"variant": names[-1]}}
        return KernelPlan(workload="w", operator="dense", shape_vars=["T"], axes=axes, target={"kind": "llvm"},
                          tvm_version=tvm.__version__, variants=variants, tree=tree,
                          tuned_range={"var": "T", "min": 1, "max": 64})

    both_packed = plan({"a": packed(1, 16, 3, 1).to_dict(), "b": packed(6, 16, 1, 1).to_dict()})
    dispatched = dispatched_prim_func(spec.func, both_packed, TARGET)
    # packed kernels also skip StorageRewrite (``build.OWN_STORAGE``)
    assert has_exact_buffers(dispatched) and has_own_storage(dispatched)
    # The untuned kernel as one of the variants (beside an unpacked one): it needs compaction.
    unpacked = MicroKernel(tile=(("i", (4, 1)), ("j", (16, 1)), ("k", (1,))), vector=16, cache_scopes=("local",))
    with_default = plan({DEFAULT_VARIANT: None, "b": unpacked.to_dict()})
    dispatched = dispatched_prim_func(spec.func, with_default, TARGET)
    assert not has_exact_buffers(dispatched) and not has_own_storage(dispatched)
    assert compacted_names(tvm.IRModule({"main": dispatched}), ours=True) == ["main"]


@pytest.mark.parametrize("kernel", [packed(13, 32, 1, 2), packed(9, 48, 1, 1, 384)], ids=["13-row", "9-row kc=384"])
def test_kernels_reading_a_row_copy_match_numpy_without_compaction(kernel: MicroKernel) -> None:
    """3072-deep rows crowd one L1 set, so these tiles read a k-major copy of them: the
    workspace whose size compaction rewrote (to a 13-deep min/max of the same value)."""
    spec = dense(3072, 192, "bias_residual")
    function = build(apply_kernel(spec.func, kernel, "llvm"), TARGET)["main"]
    for length in (1, 9, 12, 13, 14, 27, 40):
        shape = {"T": length}
        inputs = random_inputs(spec, shape, seed=length)
        arguments = [pack_array(x, kernel.pack) if i == 1 else x for i, x in enumerate(inputs)]
        out = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"))
        function(*[tvm.runtime.tensor(x) for x in arguments], out)
        np.testing.assert_allclose(out.numpy(), spec.reference(*inputs), rtol=1e-4, atol=1e-4, err_msg=f"T={length}")
