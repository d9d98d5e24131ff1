"""The CUDA micro-kernel space fits the GPU, and every kernel applied to BERT's operators with
local padding compiles with nvcc and keeps bound checks out of the FMA loop (no GPU needed)."""

from __future__ import annotations

import functools
import shutil

import pytest
from tvm import s_tir
from tvm.target import Target

from dietserve.compile.cuda import compile_fatbin
from dietserve.host.hardware import GPU_PRESETS
from dietserve.kernels.cuda.kernel import ScheduleMismatch, apply_cuda
from dietserve.kernels.cuda.source import cuda_source, inner_loop_has_bound_checks
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.gpu import (
    STATIC_SHARED_MEMORY_BYTES,
    gpu_space,
    registers_per_thread,
    shared_memory_bytes,
    threads,
)
from dietserve.kernels.tir.matching import find_matmul
from tuner.ops import OperatorSpec, attention_context, attention_scores, dense

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

OPERATORS = {
    "dense_bias_gelu": lambda: dense(768, 3072, "bias_gelu"),
    "dense_bias_ragged": lambda: dense(200, 100, "bias"),  # K and N off every tile boundary
    "attention_scores": attention_scores,
    "attention_context": attention_context,
}


@functools.cache
def _operator(name: str) -> OperatorSpec:
    return OPERATORS[name]()


@functools.cache
def _space(preset: str) -> tuple[MicroKernel, ...]:
    """The CUDA-core kernels of the preset's space (tensor-core ones: test_tensor_core_kernels.py)."""
    return tuple(kernel for kernel in gpu_space(GPU_PRESETS[preset]) if not kernel.mma)


def _kernel(tm: int, ty: int, tn: int, tx: int, bk: int, vector: int = 4, unroll: int = 64) -> MicroKernel:
    return MicroKernel(tile=(("i", (tm, ty)), ("j", (tn, tx)), ("k", (bk,))), unroll=unroll, vector=vector,
                       cache_scopes=("shared", "local"))


# Per GPU: a typical kernel, the one with the most shared memory (dynamic on the H100) and the
# one with the smallest block tile; each is checked to be a member of that GPU's space.
def _picked(preset: str) -> dict[str, MicroKernel]:
    space = _space(preset)
    typical = _kernel(4, 8, 4, 16, 16)
    assert typical in space
    return {
        "typical": typical,
        "largest_shared": max(space, key=shared_memory_bytes),
        "smallest_tile": min(space, key=lambda k: (k.tile_of("i") * k.tile_of("j"), -k.vector, k.unroll)),
    }


CASES = [(preset, choice, op) for preset in ("h100", "t4") for choice in ("typical", "largest_shared", "smallest_tile")
         for op in OPERATORS]


@pytest.mark.parametrize("preset", ["h100", "t4"])
def test_space_respects_the_gpu_limits(preset: str) -> None:
    hw, space = GPU_PRESETS[preset], _space(preset)
    assert 200 <= len(space) <= 2500 and len(set(space)) == len(space)
    for kernel in space:
        assert threads(kernel) % hw.warp_size == 0 and threads(kernel) <= hw.max_threads_per_block
        assert shared_memory_bytes(kernel) <= hw.max_shared_memory_per_block
        assert registers_per_thread(kernel) <= hw.registers_per_thread
        assert threads(kernel) * registers_per_thread(kernel) <= hw.registers_per_block
        dynamic = shared_memory_bytes(kernel) > STATIC_SHARED_MEMORY_BYTES
        assert kernel.cache_scopes == ("shared.dyn" if dynamic else "shared", "local")
        assert kernel.vector in (1, 2, 4) and kernel.tile_of("k") % kernel.vector == 0


def test_space_differs_between_h100_and_t4() -> None:
    h100, t4 = set(_space("h100")), set(_space("t4"))
    assert h100 != t4
    assert max(map(shared_memory_bytes, h100)) > GPU_PRESETS["t4"].max_shared_memory_per_block // 2
    assert max(map(shared_memory_bytes, t4)) <= GPU_PRESETS["t4"].max_shared_memory_per_block // 2
    assert any(kernel.cache_scopes[0] == "shared.dyn" for kernel in h100)


def test_space_shrinks_with_the_hardware() -> None:
    small = GPU_PRESETS["t4"].with_overrides(max_threads_per_block=128, max_shared_memory_per_block=16 * 1024)
    space = [kernel for kernel in gpu_space(small) if not kernel.mma]
    assert 0 < len(space) < len(_space("t4"))
    assert all(threads(k) <= 128 and 2 * shared_memory_bytes(k) <= 16 * 1024 for k in space)


@needs_nvcc
@pytest.mark.parametrize(("preset", "choice", "op"), CASES)
def test_kernel_compiles_with_nvcc_and_keeps_checks_out_of_the_fma_loop(preset: str, choice: str, op: str) -> None:
    hw = GPU_PRESETS[preset]
    kernel = _picked(preset)[choice]
    scheduled = apply_cuda(_operator(op).func, kernel, loop_partition=choice == "typical")
    assert scheduled.attrs["tirx.is_scheduled"]
    source = cuda_source(scheduled, hw.arch)
    assert "__shared__" in source
    assert not inner_loop_has_bound_checks(source), f"{kernel} on {op}"
    assert compile_fatbin(source, Target({"kind": "cuda", "arch": hw.arch}))


@pytest.mark.parametrize("op", ["dense_bias_gelu", "attention_scores", "attention_context"])
def test_divisible_static_shape_needs_no_padding_and_no_checks(op: str) -> None:
    kernel = _kernel(4, 8, 4, 16, 16)
    source = cuda_source(apply_cuda(_operator(op).static({"T": 128}), kernel), "sm_90")
    assert "_pad" not in source and not inner_loop_has_bound_checks(source)


def test_checker_flags_a_plain_split_of_a_symbolic_reduction() -> None:
    sch = s_tir.Schedule(attention_context().func)
    block, _ = find_matmul(sch)
    batch, i, j, k = sch.get_loops(block)
    sch.bind(sch.fuse(batch, i), "blockIdx.x")
    sch.bind(j, "threadIdx.x")
    sch.split(k, [None, 4])  # no padding: `k < T` guards every multiply-accumulate
    assert inner_loop_has_bound_checks(cuda_source(sch.mod["main"], "sm_90"))


def test_checker_refuses_source_without_multiply_accumulate() -> None:
    with pytest.raises(ValueError, match="multiply-accumulate"):
        inner_loop_has_bound_checks('extern "C" __global__ void k(float* x) {\n  x[0] = 1.0f;\n}\n')


def test_cpu_kernel_is_a_schedule_mismatch() -> None:
    cpu_kernel = MicroKernel(tile=(("i", (6, 2)), ("j", (16,)), ("k", (64,))), vector=16)
    with pytest.raises(ScheduleMismatch, match="CUDA micro-kernel"):
        apply_cuda(_operator("attention_scores").func, cpu_kernel)
    local_operands = MicroKernel(tile=(("i", (4, 8)), ("j", (4, 16)), ("k", (16,))), cache_scopes=("local",))
    with pytest.raises(ScheduleMismatch, match="operand tiles"):
        apply_cuda(_operator("attention_scores").func, local_operands)
