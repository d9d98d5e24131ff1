"""Tensor-core micro-kernels (WMMA, fp16 operands, fp32 accumulation and I/O) without a GPU: the
space fits the GPU and starts at sm_80, the plan format keeps old kernels readable, every kernel of
the space applied to a dense layer with local padding generates mma code with no bound check
around it, nvcc compiles a sample of them and every operator for sm_80 and sm_90, and a plan with
a tensor-core variant links into the model. Numerics: tests/gpu/test_tuner_cuda_gpu.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import pytest
import tvm
from tvm.target import Target

from dietserve.compile.cuda import compile_fatbin
from dietserve.host.hardware import GPU_PRESETS
from dietserve.kernels.apply import apply_kernel
from dietserve.kernels.cuda.source import cuda_source, inner_loop_has_bound_checks
from dietserve.kernels.cuda.tensor_core import apply_tensor_core
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan, PlanError
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.gpu import STATIC_SHARED_MEMORY_BYTES, gpu_space
from dietserve.kernels.space.gpu_tensor_core import (
    VECTOR,
    operand_bytes,
    registers_per_thread,
    shared_memory_bytes,
    tensor_core_kernel,
    tensor_core_space,
    warps,
)
from dietserve.kernels.tir.matching import ScheduleMismatch
from tuner.ops import OperatorSpec, attention_context, attention_scores, dense

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

OPERATORS = {
    "dense_bias_gelu": lambda: dense(384, 1536, "bias_gelu"),  # MiniLM's FFN up-projection
    "dense_bias_ragged": lambda: dense(200, 100, "bias"),  # K and N off every tile boundary
    "dense_bias_residual": lambda: dense(1536, 384, "bias_residual"),
    "attention_scores": attention_scores,
    "attention_context": attention_context,
}
TYPICAL = tensor_core_kernel(2, 2, 2, 2, 2)


@functools.cache
def _operator(name: str) -> OperatorSpec:
    return OPERATORS[name]()


@functools.cache
def _space() -> tuple[MicroKernel, ...]:
    """The tensor-core kernels of the A100's and the H100's spaces."""
    return tuple(dict.fromkeys(tensor_core_space(GPU_PRESETS["a100"]) + tensor_core_space(GPU_PRESETS["h100"])))


def _sample() -> dict[str, MicroKernel]:
    """Kernels at the space's corners, each checked to be in it."""
    space = _space()
    picked = {
        "typical": TYPICAL,
        "largest_shared": max(space, key=shared_memory_bytes),
        "most_registers": max(space, key=registers_per_thread),
        "smallest_tile": min(space, key=lambda k: k.tile_of("i") * k.tile_of("j") * k.tile_of("k")),
        "most_warps": max(space, key=lambda k: (warps(k), k.tile_of("k"))),
        "deepest_step_one_warp": max((k for k in space if warps(k) == 1),
                                     key=lambda k: (k.tile_of("k"), k.tile_of("i"))),
    }
    assert all(kernel in space for kernel in picked.values())
    return picked


def test_space_lists_tensor_core_kernels_from_sm80_only() -> None:
    assert tensor_core_space(GPU_PRESETS["t4"]) == [] and not any(k.mma for k in gpu_space(GPU_PRESETS["t4"]))
    for preset in ("a100", "h100"):
        hw = GPU_PRESETS[preset]
        listed = [kernel for kernel in gpu_space(hw) if kernel.mma]
        assert listed == tensor_core_space(hw) and 100 <= len(listed) <= 400
    assert TYPICAL in tensor_core_space(GPU_PRESETS["a100"])


@pytest.mark.parametrize("preset", ["a100", "h100"])
def test_tensor_core_space_respects_the_gpu_limits(preset: str) -> None:
    hw = GPU_PRESETS[preset]
    for kernel in tensor_core_space(hw):
        threads = warps(kernel) * hw.warp_size
        assert threads <= hw.max_threads_per_block
        assert 2 * shared_memory_bytes(kernel) <= hw.max_shared_memory_per_block
        assert registers_per_thread(kernel) <= hw.registers_per_thread
        assert 2 * threads * registers_per_thread(kernel) <= hw.registers_per_block
        assert operand_bytes(kernel) <= STATIC_SHARED_MEMORY_BYTES and kernel.cache_scopes == ("shared", "shared.dyn")
        assert (kernel.tile_of("i") * kernel.tile_of("k")) % (threads * VECTOR) == 0


def test_plan_format_reads_old_kernels_and_checks_tensor_core_ones() -> None:
    old = {"cache_scopes": ["shared", "local"], "pack": 0, "threads": 0, "unroll": 64, "vector": 4,
           "tile": [["i", [4, 8]], ["j", [4, 16]], ["k", [16]]]}
    assert MicroKernel.from_dict(old).mma == "" and json.loads(MicroKernel.from_dict(old).to_json()) == old
    assert MicroKernel.from_json(TYPICAL.to_json()) == TYPICAL and TYPICAL.to_dict()["mma"] == "wmma_f16"
    fields = dict(workload="00ff00ff00ff00ff", operator="fused_matmul_add", shape_vars=["batch", "seq_len"],
                  axes={"b": "1", "i": "batch * seq_len", "j": "384", "k": "384"},
                  target={"kind": "cuda", "arch": "sm_90"}, tvm_version="0.27.0", tree={"variant": "tc"},
                  tuned_range={"var": "batch * seq_len", "min": 1, "max": 512})
    assert KernelPlan(**fields, variants={"tc": TYPICAL.to_dict()}).kernel("tc") == TYPICAL
    for broken, message in [({"mma": "wmma_tf32"}, "unknown tensor-core kind"),
                            ({"tile": old["tile"]}, "3 levels"),
                            ({"tile": [["i", [8, 2, 2]], ["j", [16, 2, 2]], ["k", [16, 2]]]}, "16-wide fragment")]:
        with pytest.raises(PlanError, match=message):
            KernelPlan(**fields, variants={"tc": {**TYPICAL.to_dict(), **broken}})


def test_every_kernel_of_the_space_keeps_checks_out_of_the_mma_loop_of_a_dense() -> None:
    func = _operator("dense_bias_gelu").func
    for kernel in _space():
        source = cuda_source(apply_tensor_core(func, kernel), "sm_80")
        assert "wmma::mma_sync" in source and "half" in source, kernel
        assert not inner_loop_has_bound_checks(source), kernel


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("choice", ["typical", "largest_shared", "most_registers", "smallest_tile", "most_warps",
                                    "deepest_step_one_warp"])
def test_sampled_kernels_of_the_space_compile_with_nvcc(choice: str, arch: str) -> None:
    source = cuda_source(apply_tensor_core(_operator("dense_bias_gelu").func, _sample()[choice]), arch)
    assert compile_fatbin(source, Target({"kind": "cuda", "arch": arch}))


@needs_nvcc
@pytest.mark.parametrize(("pipeline", "loop_partition"), [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("op", list(OPERATORS))
def test_operator_kernels_keep_checks_out_of_the_mma_loop_and_compile(op: str, pipeline: bool,
                                                                      loop_partition: bool) -> None:
    scheduled = apply_tensor_core(_operator(op).func, TYPICAL, loop_partition=loop_partition, pipeline=pipeline)
    assert scheduled.attrs["tirx.is_scheduled"]
    source = cuda_source(scheduled, "sm_90")
    assert source.count("wmma::mma_sync") >= (2 if pipeline else 1)  # the pipeline's last step apart
    assert not inner_loop_has_bound_checks(source), f"{op} pipeline={pipeline} lp={loop_partition}"
    assert compile_fatbin(source, Target({"kind": "cuda", "arch": "sm_90"}))


@pytest.mark.parametrize("op", ["dense_bias_gelu", "attention_scores", "attention_context"])
def test_divisible_static_shape_needs_no_padding(op: str) -> None:
    source = cuda_source(apply_tensor_core(_operator(op).static({"T": 128}), TYPICAL), "sm_90")
    assert "_pad" not in source and not inner_loop_has_bound_checks(source)


def test_checker_tells_element_checks_from_a_guard_on_the_step_count() -> None:
    mma = "nvcuda::wmma::mma_sync(acc[0], a[0], b[0], acc[0]);"
    guarded = f"for (int k = 0; k < 2; ++k) {{\nif (((int64_t)threadIdx.x) < T) {{\n{mma}\n}}\n}}\n"
    step_guard = f"if ((int64_t)1 <= T) {{\nfor (int k = 0; k < 2; ++k) {{\n{mma}\n}}\n}}\n"
    assert inner_loop_has_bound_checks(guarded)
    assert not inner_loop_has_bound_checks(step_guard)


def test_other_kernels_and_targets_are_schedule_mismatches() -> None:
    cuda_core = MicroKernel(tile=(("i", (4, 8)), ("j", (4, 16)), ("k", (16,))), vector=4,
                            cache_scopes=("shared", "local"))
    with pytest.raises(ScheduleMismatch, match="not a tensor-core"):
        apply_tensor_core(_operator("attention_scores").func, cuda_core)
    with pytest.raises(ScheduleMismatch, match="CUDA targets only"):
        apply_kernel(_operator("attention_scores").func, TYPICAL, Target({"kind": "llvm", "num-cores": 2}))


@needs_nvcc
def test_plan_with_a_tensor_core_variant_links_into_the_model_and_builds_for_cuda(tmp_path: Path) -> None:
    """As tests/integration/test_cuda_build.py builds split plans: here one variant of each is
    the tensor-core kernel, linked behind the decision tree beside a CUDA-core kernel and the
    default rule's."""
    from dietserve.compile.artifact import CompileRequest, compile_artifact
    from dietserve.compile.target import TargetSpec
    from dietserve.compile.tuning import tuning_tasks
    from dietserve.kernels.plan.decision_tree import interval_tree
    from dietserve.kernels.plan.kernel_plan import plan_path
    from dietserve.kernels.tir.matching import matmul_axes
    from dietserve.runtime.cuda_kernels import FATBIN_FILE
    from dietserve.runtime.manifest import Manifest

    cuda_core = MicroKernel(tile=(("i", (4, 8)), ("j", (4, 16)), ("k", (16,))), unroll=64, vector=4,
                            cache_scopes=("shared", "local"))
    variants = {"cuda": cuda_core.to_dict(), "tc": TYPICAL.to_dict(), DEFAULT_VARIANT: None}
    request = CompileRequest(model="default", target=TargetSpec(kind="cuda", arch="sm_90"), max_batch=8)
    tasks = tuning_tasks(request, tmp_path / "cache")
    for task in tasks.tasks:
        if task.vary["var"] != "seq_len":  # the pooling sum: no [i,k]x[k,j] product to tile
            continue
        axes = matmul_axes(tvm.ir.load_json(task.func))
        KernelPlan(workload=task.workload, operator=task.operator, shape_vars=["batch", "seq_len"], axes=axes,
                   target=tasks.target, tvm_version=str(tvm.__version__), variants=variants,
                   tree=interval_tree(axes["i"], [8, 16, 4096], ["cuda", DEFAULT_VARIANT, "tc"]),
                   tuned_range={"var": axes["i"], "min": 1, "max": 4096},
                   provenance={"model": {"name": "test"}}).write(plan_path(tmp_path / "plans", task.workload))
    artifact = compile_artifact(dataclasses.replace(request, plans=(tmp_path / "plans",)), tmp_path / "cache",
                                tmp_path / "artifact")
    manifest = Manifest.read(artifact)
    assert (artifact / FATBIN_FILE).read_bytes()[:4] == bytes.fromhex("50ed55ba")  # nvcc's fatbin
    linked = [entry for entry in manifest.dispatch.values() if "tc" in entry["variants"]]
    assert len(linked) >= 6  # QKV, attention output, FFN up and down, the two attention products
