"""bf16 dense kernels (``kernels/cpu_packed/bf16.py``): every kernel of the space against numpy
on bf16-rounded operands at lengths 1..512, the rounding against torch's, the weight's pairs
packed alike by numpy and by the PrimFunc the model runs at load, and the precision a plan, a
task file and a target must agree on. The kernels run only on a CPU with AVX512-BF16; the
tests that run them skip elsewhere."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm

from dietserve.host.cpu import cpu_flags
from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.apply import apply_kernel
from dietserve.kernels.cpu_packed import bf16
from dietserve.kernels.cpu_packed.kernel import crowding_rows, packed_tile
from dietserve.kernels.cpu_varlen.attention import bf16_attention_fits, varlen_attention
from dietserve.kernels.cpu_varlen.tile import VarlenTile
from dietserve.kernels.plan.kernel_plan import KernelPlan, PlanError
from dietserve.kernels.plan.task_file import TaskFile, TaskFileError
from dietserve.kernels.space import task_space
from dietserve.kernels.space.analytic import analytic_plan
from dietserve.kernels.space.cpu import packed_cpu_space
from dietserve.kernels.tir.build import build
from dietserve.kernels.tir.matching import ScheduleMismatch
from tuner.ops import dense, kernel_inputs, random_inputs

from .kernel_builds import build_each
from .test_varlen_attention import reference

HAS_BF16 = "avx512_bf16" in (cpu_flags() or set())
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512-BF16 (vdpbf16ps)")
TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})  # (has AVX512-BF16)
AVX512 = CPU_PRESETS["avx512"]
LENGTHS = (1, 2, 3, 7, 13, 16, 31, 64, 127, 128, 129, 300, 512)
K, N = 192, 192  # 96 pair steps, whole in registers; 12 panels of 16, 4 of 48
DEEP = 1536  # 768 pair steps: reduction blocks of 256 and 384 fit


def _bf16_dense(epilogue: str):
    return dense(K, N, epilogue, precision="bf16")


def _run(function, spec, pack: int, length: int) -> tuple[np.ndarray, list[np.ndarray]]:
    shape = {"T": length}
    inputs = random_inputs(spec, shape, seed=length)
    out = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"))
    function(*[tvm.runtime.tensor(x) for x in kernel_inputs(spec, inputs, pack)], out)
    return out.numpy(), inputs


def _expected(spec, inputs: list[np.ndarray], rounded: bool) -> np.ndarray:
    """numpy on the operands as a bf16 kernel reads them (X and W rounded to bf16), fp32 sums."""
    operands = [bf16.bf16_rounded(x) if rounded and i < 2 else x for i, x in enumerate(inputs)]
    return spec.reference(*operands)


def test_rounding_is_torchs_nearest_even() -> None:
    import torch

    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 100,
                             np.float32([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4e38, -3.4e38, 1e-40])])
    ours = bf16.bf16_bits(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)


def test_weight_pairs_from_numpy_and_from_the_load_time_primfunc_agree() -> None:
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((K, N)).astype(np.float32)
    packed = bf16.pack_array(weight, 48)
    assert packed.shape == (N // 48, K // 2, 48) and packed.dtype == np.uint32
    function = tvm.compile(bf16.bf16_packing(K, N, 48), tvm.target.Target({"kind": "llvm"}))
    out = tvm.runtime.tensor(np.zeros(packed.shape, np.uint32))
    function(tvm.runtime.tensor(weight), out)
    np.testing.assert_array_equal(out.numpy(), packed)
    # each word: W[2k, n] in its low half, W[2k + 1, n] in its high half, both rounded
    low = (packed & 0xFFFF).astype(np.uint32) << 16
    high = packed & 0xFFFF0000
    rounded = bf16.bf16_rounded(weight)
    np.testing.assert_array_equal(low.view(np.float32).transpose(1, 0, 2).reshape(K // 2, N), rounded[0::2])
    np.testing.assert_array_equal(high.view(np.float32).transpose(1, 0, 2).reshape(K // 2, N), rounded[1::2])


def test_bf16_needs_a_cpu_with_avx512_bf16() -> None:
    bf16.check_bf16_target(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))
    bf16.check_bf16_target(tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"}))
    with pytest.raises(ValueError, match="AVX512-BF16.*znver3"):
        bf16.check_bf16_target(tvm.target.Target({"kind": "llvm", "mcpu": "znver3"}))
    with pytest.raises(ValueError, match="CPUs"):
        bf16.check_bf16_target(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"}))


def _blocks(spec) -> set[int]:
    return {k.tile_sizes("k")[0] for k in task_space(packed_cpu_space(AVX512), spec.func, AVX512)}


def test_the_space_of_a_bf16_layer_runs_16_lanes_over_pair_steps() -> None:
    kernels = task_space(packed_cpu_space(AVX512), _bf16_dense("bias").func, AVX512)
    assert kernels and all(k.pack and k.vector == bf16.PAIR_LANES for k in kernels)
    assert task_space(packed_cpu_space(CPU_PRESETS["avx2"]), _bf16_dense("bias").func) == [] or \
        all(not k.pack for k in task_space(packed_cpu_space(CPU_PRESETS["avx2"]), _bf16_dense("bias").func))
    # reduction blocks divide the pair steps (768 of K = 1536), not the depth
    assert _blocks(dense(DEEP, N, "bias", precision="bf16")) == {1, 256, 384}
    assert _blocks(dense(DEEP, N, "bias")) == {1, 256, 384, 768}


@needs_bf16
@pytest.mark.parametrize("epilogue", ["bias_gelu", "bias_residual"])
def test_every_bf16_kernel_matches_numpy_on_rounded_operands(epilogue: str) -> None:
    spec = _bf16_dense(epilogue)
    kernels = task_space(packed_cpu_space(AVX512), spec.func, AVX512)
    # every tile height and panel width, whole and blocked reductions, without building all of them
    chosen = {}
    for kernel in kernels:
        mr, panel, _, _ = packed_tile(kernel)
        chosen.setdefault((mr, panel, kernel.tile_sizes("k")[0] > 1), kernel)
    kernels = list(chosen.values())
    assert len({packed_tile(k)[0] for k in kernels}) >= 10
    _check_against_numpy(spec, kernels, LENGTHS)


@needs_bf16
def test_bf16_kernels_in_reduction_blocks_match_numpy() -> None:
    spec = dense(DEEP, 96, "bias_residual", precision="bf16")
    kernels = [k for k in task_space(packed_cpu_space(AVX512), spec.func, AVX512) if k.tile_sizes("k")[0] > 1]
    chosen = {}
    for kernel in kernels:
        chosen.setdefault((packed_tile(kernel)[0] in (1, 6, 14), kernel.tile_sizes("k")[0]), kernel)
    assert {kernel.tile_sizes("k")[0] for kernel in chosen.values()} == {256, 384}
    _check_against_numpy(spec, list(chosen.values()), (1, 5, 64, 130, 512))


@needs_bf16
@pytest.mark.parametrize("depth", [200, 2048], ids=["pair steps not whole vectors", "pair rows crowding a set"])
def test_bf16_kernels_copying_rows_k_major_match_numpy(depth: int) -> None:
    """Where X's rows cannot be converted to pairs a vector at a time (100 pair steps), or their
    4 KB rows would crowd one L1 set, a bf16 kernel copies them k-major instead."""
    spec = dense(depth, 96, "bias_residual", precision="bf16")
    kernels = task_space(packed_cpu_space(AVX512), spec.func, AVX512)
    chosen = {packed_tile(kernel)[0]: kernel for kernel in kernels if kernel.tile_sizes("k")[0] == 1}
    assert crowding_rows(14, depth * 2) is not None or depth % 32
    _check_against_numpy(spec, [chosen[mr] for mr in (1, 6, 14) if mr in chosen], (1, 5, 64, 130))


def _check_against_numpy(spec, kernels: list, lengths) -> None:
    functions = build_each(spec.func, kernels, TARGET, where=TARGET)
    apart_from_fp32 = 0.0
    for function, kernel in zip(functions, kernels, strict=True):
        for length in lengths:
            got, inputs = _run(function, spec, kernel.pack, length)
            np.testing.assert_allclose(got, _expected(spec, inputs, rounded=True), rtol=1e-4, atol=1e-4,
                                       err_msg=f"{kernel} T={length}")
            apart_from_fp32 = max(apart_from_fp32, float(np.abs(got - _expected(spec, inputs, False)).max()))
    assert apart_from_fp32 > 1e-3  # it does round: an fp32 kernel would not pass as this one


def test_a_bf16_kernel_multiplies_pairs_with_vdpbf16ps_on_half_the_weight_bytes() -> None:
    """The same micro-kernel built both ways (code read, not run: any host builds it)."""
    fp32, wide = dense(K, N, "bias"), _bf16_dense("bias")
    kernel = next(k for k in task_space(packed_cpu_space(AVX512), wide.func, AVX512) if packed_tile(k)[0] == 6)
    asm = build(apply_kernel(wide.func, kernel, TARGET), TARGET).mod.inspect_source("asm")
    assert asm.count("vdpbf16ps") >= 6  # (a 6-row tile: one per row and vector, the call inlined)
    # X's rows become pairs 16 at a time, stored contiguously: no scatter of words a row apart
    assert "vcvtne2ps2bf16" in asm and "vpscatter" not in asm
    assert "dietserve_dpbf16ps" not in asm  # inlined: no call, no copy of the function left
    with pytest.raises(ScheduleMismatch, match="AVX512-BF16"):
        apply_kernel(wide.func, kernel, tvm.target.Target({"kind": "llvm", "mcpu": "znver3"}))
    inputs = random_inputs(fp32, {"T": 4})
    assert kernel_inputs(wide, inputs, kernel.pack)[1].nbytes * 2 == kernel_inputs(fp32, inputs, kernel.pack)[1].nbytes


def test_a_plan_records_its_precision_and_another_is_refused() -> None:
    plan = analytic_plan(_bf16_dense("bias").func, "dense", {"var": "T", "values": list(range(1, 65))}, {}, [],
                         {"kind": "llvm", "mcpu": "znver4"}, str(tvm.__version__), AVX512, precision="bf16")
    assert plan.precision == "bf16" and all(plan.kernel(v).vector == 16 for v in plan.variants)
    assert all(plan.kernel(v).tile_sizes("k")[0] == 1 for v in plan.variants)  # (96 pair steps: no block fits)
    assert KernelPlan.from_dict(dataclasses.asdict(plan)).precision == "bf16"
    plan.check_precision("bf16")
    with pytest.raises(PlanError, match="tuned for bf16 products, this build is fp32"):
        plan.check_precision("fp32")
    old = {k: v for k, v in dataclasses.asdict(plan).items() if k != "precision"}  # before the field existed
    assert KernelPlan.from_dict(old).precision == "fp32"
    with pytest.raises(PlanError, match="precision 'fp16'"):
        KernelPlan.from_dict({**old, "precision": "fp16"})


def test_a_task_file_carries_the_builds_precision(tmp_path) -> None:
    tasks = TaskFile(model={"name": "m"}, target={"kind": "llvm"}, tasks=[], precision="bf16")
    assert TaskFile.read(tasks.write(tmp_path / "tasks.json")).precision == "bf16"
    with pytest.raises(TaskFileError, match="precision 'int8'"):
        TaskFile(model={}, target={}, tasks=[], precision="int8")


@needs_bf16
def test_the_tuner_times_bf16_kernels_and_writes_a_bf16_plan(tmp_path) -> None:
    """A real tuner process: its candidates pass the check against numpy on bf16-rounded operands
    (an fp32 candidate would not), and the plan it writes says bf16 and builds a bf16 kernel."""
    import json
    import subprocess
    import sys

    database = tmp_path / "records.jsonl"
    tune = subprocess.run(
        [sys.executable, "-m", "tuner", "tune", "--op", "dense", "--k", "128", "--n", "96", "--epilogue", "bias",
         "--precision", "bf16", "--t", "1:32", "--trials", "6", "--db", str(database), "--number", "1",
         "--repeat", "1", "--plan-weights", "cache"],
        capture_output=True, text=True, timeout=600)
    assert tune.returncode == 0, tune.stderr
    assert "6 trials (0 failed)" in tune.stderr, tune.stderr
    plan = KernelPlan.read(database.with_suffix(".plan.json"))
    assert plan.precision == "bf16" and plan.pack and all(plan.kernel(v).vector == 16 for v in plan.variants)
    records = [json.loads(line) for line in database.read_text().splitlines()]
    assert all("+bf16" in record["workload"] for record in records)


def _bf16_attention_reference(qkv: np.ndarray, starts: np.ndarray, heads: int, head_dim: int,
                              window: int | None = None, causal: bool = False) -> np.ndarray:
    """softmax(q k^T / sqrt(d)) v per sequence and head, with the products' operands rounded to
    bf16 as the kernel multiplies them (the scaled queries, the keys, the exponentials and the
    values), the softmax and every sum in float64; ``window``: keys farther from the query get
    no weight, ``causal``: keys after it."""
    width, rounded = heads * head_dim, bf16.bf16_rounded
    out = np.zeros((qkv.shape[0], width))
    scale = np.float32(1 / np.sqrt(head_dim))
    for first, end in zip(starts[:-1], starts[1:], strict=True):
        block = qkv[first:end]
        for h in range(heads):
            q, k, v = (block[:, (part * heads + h) * head_dim:(part * heads + h + 1) * head_dim] for part in range(3))
            scores = rounded(q * scale).astype(np.float64) @ rounded(k).astype(np.float64).T
            positions = np.arange(end - first)
            if window is not None:
                scores[np.abs(positions[None, :] - positions[:, None]) > window] = -np.inf
            if causal:
                scores[positions[None, :] > positions[:, None]] = -np.inf
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            context = rounded(weights.astype(np.float32)).astype(np.float64) @ rounded(v).astype(np.float64)
            out[first:end, h * head_dim:(h + 1) * head_dim] = context / weights.sum(axis=1, keepdims=True)
    return out


@needs_bf16
@pytest.mark.parametrize("tile", [VarlenTile(mr=6, nr=32, nc=32, lanes=16), VarlenTile(mr=1, nr=16, nc=16, lanes=16),
                                  VarlenTile(mr=4, nr=48, nc=64, lanes=16)], ids=lambda t: t.describe())
@pytest.mark.parametrize("reach", [8, 64, "causal"], ids=lambda r: r if r == "causal" else f"window {r}")
def test_bf16_masked_attention_attends_within_its_reach_alone(tile: VarlenTile, reach) -> None:
    """ModernBERT's windowed layers and a decoder's on bf16 pairs: the kernel skips the key tiles
    outside the window (from the 32-key block holding its first key) or after a query tile's last
    query, and its bias masks the rest; the reference masks exactly."""
    from dietserve.host.cpu import configure_cpu_threads
    from dietserve.model.modernbert import window_bias

    configure_cpu_threads(2)
    heads, head_dim, max_len = 2, 64, 512
    causal, window = reach == "causal", None if reach == "causal" else reach
    func = varlen_attention(heads, head_dim, max_len, tile, precision="bf16", relative_bias=True,
                            window=window, causal=causal).with_attr("global_symbol", "main")
    function = build(tvm.IRModule({"main": func}), TARGET)["main"]
    bias = tvm.runtime.tensor(window_bias(heads, max_len, window, causal))
    rng = np.random.default_rng(3)
    for lengths in ([1], [7, 1, 13], [512], [31, 2, 97, 5, 1], [128, 64, 61]):
        qkv = (rng.standard_normal((sum(lengths), 3 * heads * head_dim)) * 2).astype(np.float32)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        out = tvm.runtime.tensor(np.full((qkv.shape[0], heads * head_dim), np.nan, np.float32))
        function(tvm.runtime.tensor(qkv), tvm.runtime.tensor(starts), bias, out)
        apart = np.abs(out.numpy() - _bf16_attention_reference(qkv, starts, heads, head_dim, window, causal))
        assert apart.max() < 2e-2 and (apart > 1e-3).mean() < 5e-3, (tile.describe(), lengths, apart.max())


@needs_bf16
@pytest.mark.parametrize("tile", [VarlenTile(mr=6, nr=32, nc=32, lanes=16), VarlenTile(mr=1, nr=16, nc=16, lanes=16),
                                  VarlenTile(mr=4, nr=48, nc=64, lanes=16)], ids=lambda t: t.describe())
@pytest.mark.parametrize("head_dim", [64, 48])  # (48: K's pairs made from an fp32 copy, not transposed as words)
def test_bf16_attention_matches_numpy_on_rounded_operands(tile: VarlenTile, head_dim: int) -> None:
    from dietserve.host.cpu import configure_cpu_threads

    configure_cpu_threads(2)
    heads, max_len = 2, 512
    func = varlen_attention(heads, head_dim, max_len, tile, precision="bf16").with_attr("global_symbol", "main")
    function = build(tvm.IRModule({"main": func}), TARGET)["main"]
    rng = np.random.default_rng(0)
    for lengths in ([1], [2], [3, 1], [7, 1, 13], [512], [31, 2, 97, 5, 1], [128, 64, 61]):
        qkv = (rng.standard_normal((sum(lengths), 3 * heads * head_dim)) * 2).astype(np.float32)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        out = tvm.runtime.tensor(np.full((qkv.shape[0], heads * head_dim), np.nan, np.float32))
        function(tvm.runtime.tensor(qkv), tvm.runtime.tensor(starts), out)
        got, expected = out.numpy(), _bf16_attention_reference(qkv, starts, heads, head_dim)
        # the exponentials' error (about 2e-7 relative) moves an exponential across a bf16 rounding
        # boundary now and then: one bf16 step (2^-8) of one weight, in a few outputs only
        apart = np.abs(got - expected)
        assert apart.max() < 2e-2 and (apart > 1e-3).mean() < 5e-3, (tile.describe(), lengths, apart.max())
        if max(lengths) > 1:  # (one key: its weight is exactly 1)
            assert float(np.abs(got - reference(qkv, starts, heads, head_dim)).max()) > 3e-3  # it does round


@needs_bf16
def test_the_exp_of_bf16_attention_weights_matches_numpy() -> None:
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    from dietserve.kernels.tir.fast_exp import avx512_softmax_exp

    size = 1 << 16
    with IRBuilder() as builder:
        with T.prim_func():
            x, y = T.arg("x", T.Buffer((size,), "float32")), T.arg("y", T.Buffer((size,), "float32"))
            T.func_attr({"global_symbol": "main"})
            with T.serial(0, size // 16) as v:
                vector = tirx.Ramp(v * 16, 1, 16)
                T.buffer_store(y, avx512_softmax_exp(x[vector]), [vector])
    function = build(tvm.IRModule({"main": builder.get()}), TARGET)["main"]
    rng = np.random.default_rng(0)
    # every range a softmax meets: near 0, across many powers of two, into underflow
    values = np.concatenate([-rng.uniform(0, 1, size // 4), -rng.uniform(0, 90, size // 4),
                             -np.logspace(-9, 3, size // 4), -rng.uniform(100, 3e38, size // 4 - 1), [0.0]])
    out = tvm.runtime.tensor(np.full(size, np.nan, np.float32))
    function(tvm.runtime.tensor(values.astype(np.float32)), out)
    got, expected = out.numpy().astype(np.float64), np.exp(values.astype(np.float32).astype(np.float64))
    normal = expected > np.finfo(np.float32).tiny
    assert float(np.abs(got[normal] / expected[normal] - 1).max()) < 5e-7
    assert float(np.abs(got[~normal]).max()) < 2 * np.finfo(np.float32).tiny and got[-1] == 1.0


def test_bf16_attention_needs_16_lane_tiles_over_an_even_head_dim() -> None:
    assert bf16_attention_fits(VarlenTile(mr=6, nr=32, nc=32, lanes=16), 64)
    assert not bf16_attention_fits(VarlenTile(mr=4, nr=16, nc=16, lanes=8), 64)  # AVX2's 8 lanes
    assert not bf16_attention_fits(VarlenTile(mr=6, nr=32, nc=32, lanes=16), 24)  # context vectors of 8
    with pytest.raises(ValueError, match="bf16 attention needs 16-lane tiles"):
        varlen_attention(2, 24, 64, VarlenTile(mr=6, nr=32, nc=32, lanes=16), precision="bf16")
