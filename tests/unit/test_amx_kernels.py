"""AMX kernels (``kernels/cpu_packed/amx.py``): every AMX kernel of the space against numpy on
bf16-rounded operands at lengths 1..512, on emulated tiles (any CPU: the same kernel code over
``EmulatedTiles``, which reads the tile configuration as the hardware does) and, on a CPU with
AMX-BF16, on the tiles themselves; the instructions in the code built for an AMX target; the
space and the cold-start plans that offer them; and the system call each kernel makes first."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import tvm
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from dietserve.host.cpu import cpu_flags, host_cpu
from dietserve.host.hardware import CPU_PRESETS, detect_cpu
from dietserve.kernels.apply import apply_kernel
from dietserve.kernels.cpu_packed import amx, bf16
from dietserve.kernels.cpu_packed.kernel import computed_extent
from dietserve.kernels.cpu_packed.settings import PackedSettings, packed_settings
from dietserve.kernels.decision_tree_func import dispatched_prim_func
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.settings import KernelSettings
from dietserve.kernels.space import task_space
from dietserve.kernels.space.analytic import analytic_plan
from dietserve.kernels.space.cpu import amx_cpu_space, packed_cpu_space
from dietserve.kernels.tir.build import build
from dietserve.kernels.tir.matching import ScheduleMismatch
from tuner.ops import dense, kernel_inputs, random_inputs

from .kernel_builds import build_each

HAS_AMX = {"amx_tile", "amx_bf16"} <= (cpu_flags() or set())
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16 tiles")
needs_bf16 = pytest.mark.skipif("avx512_bf16" not in (cpu_flags() or set()), reason="this CPU has no AVX512-BF16")
AMX_HOST = CPU_PRESETS["avx512"].with_overrides(matrix_tiles=True)
SAPPHIRE = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
HOST = tvm.target.Target({"kind": "llvm", "num-cores": 2})
EMULATED = KernelSettings(packed=PackedSettings(emulated_tiles=True))
LENGTHS = (1, 2, 15, 16, 17, 31, 33, 64, 100, 129, 512)
K, N = 192, 192  # 96 pair steps: 6 blocks of 16; 6 panels of 32, 4 of 48


def _amx_kernel(rows: int, panel: int, pk: int, groups: int = 1, threads: int = 0) -> MicroKernel:
    return MicroKernel(tile=(("i", (rows,)), ("j", (panel, pk, groups)), ("k", (1,))), vector=16, pack=panel,
                       mma="amx_bf16", threads=threads)


def _check_against_numpy(spec, kernels: list, functions: list, lengths) -> None:
    apart_from_fp32 = 0.0
    for function, kernel in zip(functions, kernels, strict=True):
        for length in lengths:
            shape = {"T": length}
            inputs = random_inputs(spec, shape, seed=length)
            out = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"))
            function(*[tvm.runtime.tensor(x) for x in kernel_inputs(spec, inputs, kernel.pack)], out)
            rounded = [bf16.bf16_rounded(x) if i < 2 else x for i, x in enumerate(inputs)]
            np.testing.assert_allclose(out.numpy(), spec.reference(*rounded), rtol=1e-4, atol=1e-4,
                                       err_msg=f"{kernel} T={length}")
            apart_from_fp32 = max(apart_from_fp32, float(np.abs(out.numpy() - spec.reference(*inputs)).max()))
    assert apart_from_fp32 > 1e-3  # it does round: an fp32 kernel would not pass as this one


def _space_kernels(spec) -> list[MicroKernel]:
    """One AMX kernel of the space per register tile, with tasks of one and of several groups."""
    chosen = {}
    for kernel in task_space(packed_cpu_space(AMX_HOST), spec.func, AMX_HOST):
        if kernel.mma:
            chosen.setdefault((amx.amx_tile(kernel), kernel.tile_sizes("j")[2] > 1, kernel.threads), kernel)
    return list(chosen.values())


@pytest.mark.parametrize("epilogue", ["bias_gelu", "bias_residual"])
def test_every_amx_kernel_matches_numpy_on_emulated_tiles(epilogue: str) -> None:
    spec = dense(K, N, epilogue, precision="bf16")
    kernels = _space_kernels(spec)
    assert {amx.amx_tile(k) for k in kernels} == {(1, 2), (1, 4), (2, 2), (1, 3), (1, 6)}
    assert {k.threads for k in kernels} == {0, 1}
    _check_against_numpy(spec, kernels, build_each(spec.func, kernels, HOST, HOST, EMULATED), LENGTHS)


def test_an_amx_kernel_of_bert_bases_widest_layer_matches_numpy_on_emulated_tiles() -> None:
    """3072 -> 768: 96 blocks of 32 reduction steps, a task of 4 groups of 2 tiles."""
    spec = dense(3072, 768, "bias_residual", precision="bf16")
    kernels = [_amx_kernel(16, 32, 2, 4)]
    _check_against_numpy(spec, kernels, build_each(spec.func, kernels, HOST, HOST, EMULATED), (1, 37))


def test_the_kernel_built_for_sapphire_rapids_runs_on_the_tiles() -> None:
    """Code read, not run (any host builds it): per 32 reduction steps each A and B tile loaded
    once and one tdpbf16ps per C tile, the tiles configured and released per task."""
    spec = dense(K, N, "bias_gelu", precision="bf16")
    kernel = _amx_kernel(32, 32, 1, 3)  # 2 x 2 C tiles, 2 A tiles, 2 B tiles: all 8 registers
    assert amx.tile_registers(2, 2) == ([[0, 1], [2, 3]], [4, 5], [6, 7])
    asm = build(apply_kernel(spec.func, kernel, SAPPHIRE), SAPPHIRE).mod.inspect_source("asm")
    products, loads = asm.count("tdpbf16ps"), asm.count("tileloadd")
    assert products >= 4 and products % 4 == 0 and loads == products  # (LLVM may unroll the k loop)
    assert asm.count("ldtilecfg") == 1 and asm.count("tilerelease") == 1 and asm.count("tilezero") == 4
    assert asm.count("tilestored") == 4 and re.search(r"\tcallq?\tsyscall", asm)
    assert "%tmm7" in asm and "%tmm8" not in asm


def test_amx_kernels_are_refused_where_they_cannot_run() -> None:
    kernel = _amx_kernel(16, 32, 1)
    with pytest.raises(ScheduleMismatch, match="AMX-BF16 tiles"):
        apply_kernel(dense(K, N, "bias", precision="bf16").func, kernel, tvm.target.Target(
            {"kind": "llvm", "mcpu": "znver4"}))
    with pytest.raises(ScheduleMismatch, match="--precision bf16"):
        apply_kernel(dense(K, N, "bias").func, kernel, SAPPHIRE)
    with pytest.raises(ScheduleMismatch, match="CPU targets only"):
        apply_kernel(dense(K, N, "bias").func, kernel, tvm.target.Target({"kind": "cuda", "arch": "sm_90"},
                                                                          host={"kind": "llvm"}))
    with pytest.raises(ScheduleMismatch, match="8 tile registers"):
        amx.tile_registers(2, 4)


def test_amx_kernels_are_checked_as_data() -> None:
    kernel = _amx_kernel(32, 48, 1, 2)
    assert MicroKernel.from_json(kernel.to_json()) == kernel and "mma=amx_bf16" in str(kernel)
    for rows, panel, k in ((8, 32, (1,)), (16, 24, (1,)), (16, 32, (256,))):
        with pytest.raises(ValueError, match="AMX kernel"):
            MicroKernel(tile=(("i", (rows,)), ("j", (panel, 1, 1)), ("k", k)), vector=16, pack=panel, mma="amx_bf16")
    with pytest.raises(ValueError, match="AMX kernel"):
        MicroKernel(tile=(("i", (16,)), ("j", (32, 1, 1)), ("k", (1,))), vector=16, mma="amx_bf16")  # unpacked
    assert computed_extent(kernel, "i", 1) == 32 and computed_extent(kernel, "i", 33) == 64  # whole tiles


def test_the_space_offers_amx_kernels_to_bf16_layers_on_cpus_with_tiles() -> None:
    assert amx_cpu_space(CPU_PRESETS["avx512"]) == []
    kernels = amx_cpu_space(AMX_HOST)
    assert kernels and all(amx.fits_tile_registers(*amx.amx_tile(k)) for k in kernels)
    assert not any(k.mma for k in task_space(packed_cpu_space(AMX_HOST), dense(K, N, "bias").func, AMX_HOST))
    assert detect_cpu({"avx512f", "avx2", "amx_tile", "amx_bf16"}).matrix_tiles
    assert not detect_cpu({"avx512f", "avx2", "avx512_bf16"}).matrix_tiles
    assert amx.has_matrix_tiles(SAPPHIRE) and packed_settings(SAPPHIRE).matrix_tiles
    assert not amx.has_matrix_tiles(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))


def test_cold_start_plans_put_long_inputs_on_amx_tiles_where_the_cpu_has_them() -> None:
    """The hardware model prices a tile product at 16x an AVX-512 core's FMA rate: the rows past
    a few tiles go to AMX; without tiles the same layer keeps its AVX512-BF16 kernels."""
    func = dense(768, 768, "bias", precision="bf16").func
    values = {"var": "T", "values": list(range(1, 513))}

    def plan(hw):
        return analytic_plan(func, "dense", values, {}, [], {"kind": "llvm", "mcpu": "sapphirerapids"},
                             str(tvm.__version__), hw, precision="bf16")

    tiled = plan(AMX_HOST)
    chosen = {entry["value"]: tiled.kernel(entry["variant"]) for entry in tiled.shapes}
    assert all(kernel.mma == "amx_bf16" for value, kernel in chosen.items() if value >= 128)
    assert not any(plan(CPU_PRESETS["avx512"]).kernel(v).mma for v in plan(CPU_PRESETS["avx512"]).variants)


def test_a_kernel_can_make_the_system_call_that_asks_for_the_tiles() -> None:
    """The call ``MatrixTiles.request_permission`` makes (``call_extern`` of libc's ``syscall``),
    here with getpid's number: it links and returns the kernel's answer, built or exported."""
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name("main")
            out = T.arg("out", T.buffer((1,), "int64"))
            T.buffer_store(out, tvm.tirx.call_extern("int64", "syscall", tvm.tirx.const(39, "int64")), [0])
    result = tvm.runtime.tensor(np.zeros(1, np.int64))
    tvm.compile(builder.get(), HOST)(result)
    assert int(result.numpy()[0]) == os.getpid()


@needs_amx
@pytest.mark.parametrize("epilogue", ["bias_gelu", "bias_residual"])
def test_every_amx_kernel_matches_numpy_on_the_tiles(epilogue: str) -> None:
    spec = dense(K, N, epilogue, precision="bf16")
    kernels = _space_kernels(spec)
    here = tvm.target.Target({"kind": "llvm", "mcpu": host_cpu(), "num-cores": 2})
    _check_against_numpy(spec, kernels, build_each(spec.func, kernels, here, here), LENGTHS)


@needs_bf16
def test_a_dispatched_plan_of_amx_and_avx512_bf16_kernels_matches_numpy() -> None:
    """A cold-start plan for a CPU with tiles, through the decision tree the model is built with:
    its short inputs on AVX512-BF16 register tiles, its long ones on (emulated) AMX tiles, one
    weight in bf16 pairs for both."""
    spec = dense(768, 768, "bias_gelu", precision="bf16")
    plan = analytic_plan(spec.func, "dense", {"var": "T", "values": list(range(1, 513))}, {}, [],
                         {"kind": "llvm", "mcpu": "sapphirerapids"}, str(tvm.__version__), AMX_HOST,
                         precision="bf16")
    kinds = {plan.kernel(name).mma for name in plan.variants}
    assert kinds == {"", "amx_bf16"}, plan.variants
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    settings = KernelSettings(packed=PackedSettings(dot_pairs=True, emulated_tiles=True))
    function = build(dispatched_prim_func(spec.func, plan, target, settings=settings), target)["main"]
    for length in (1, 5, 40, 100, 512):
        shape = {"T": length}
        inputs = random_inputs(spec, shape, seed=length)
        out = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"))
        packed = [tvm.runtime.tensor(x) for x in kernel_inputs(spec, inputs, plan.pack)]
        function(*spec.call_arguments(shape, packed, out))
        rounded = [bf16.bf16_rounded(x) if i < 2 else x for i, x in enumerate(inputs)]
        np.testing.assert_allclose(out.numpy(), spec.reference(*rounded), rtol=1e-4, atol=1e-4, err_msg=f"T={length}")
