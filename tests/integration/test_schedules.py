"""Every PrimFunc of the compiled BERT gets a real CPU schedule: no serial scalar loop nests
(TVM's default CPU build leaves all of them serial)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import s_tir, te, tirx, topi
from tvm.target.codegen import llvm_cpu_has_features

from dietserve.compile.cpu import CPUMatmul, ParallelInjective, RowReduction, cpu_schedule_rules
from dietserve.compile.cpu.injective import inlined_injective, transposed_read_loop
from dietserve.compile.cpu.serial_when_small import SERIAL_UP_TO_ELEMENTS, cpu_default_schedule
from dietserve.compile.pipeline import fast_math_passes, legalize_passes, schedule_module
from dietserve.compile.target import TargetSpec, build_target
from dietserve.model.bert import BertModel, PoolingOptions, export_relax
from dietserve.model.config import BERT_BASE, BertConfig

MINILM = BertConfig(hidden_size=384, num_hidden_layers=2, intermediate_size=1536)


def _primfuncs(config: BertConfig, mcpu: str | None = None):
    target = build_target(TargetSpec(mcpu=mcpu))
    mod, _ = export_relax(BertModel(config, PoolingOptions(normalize=True)), max_batch=4)
    scheduled = schedule_module(mod, target)
    return [(gv.name_hint, f) for gv, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]


@pytest.mark.parametrize("config", [MINILM, BERT_BASE], ids=["minilm-shape", "bert-base"])
def test_every_primfunc_runs_in_parallel(config: BertConfig) -> None:
    funcs = _primfuncs(config)
    assert len(funcs) > 15
    serial = [name for name, f in funcs if "T.parallel(" not in f.script()]
    assert not serial, f"PrimFuncs left without a parallel loop: {serial}"


@pytest.mark.parametrize("mcpu", ["skylake-avx512", "haswell"])
def test_other_cpus_get_schedules_that_compile(mcpu: str) -> None:
    """CI machines differ from this one: AVX-512 (16 lanes) and AVX2 schedules both build."""
    funcs = _primfuncs(MINILM, mcpu)
    assert all("T.parallel(" in f.script() for _, f in funcs)
    target = build_target(TargetSpec(mcpu=mcpu))
    module = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs})
    assert tvm.compile(module, target) is not None


def test_matmuls_and_row_ops_are_vectorised() -> None:
    for name, f in _primfuncs(BERT_BASE):
        if "matmul" in name or "softmax" in name or name.startswith("layer_norm"):
            assert "T.vectorized(" in f.script(), f"{name} is not vectorised"


@pytest.mark.parametrize("rows", [1, 2, 7, 13, 64, 127, 129, 300])
def test_matmul_rule_is_exact_for_any_row_count(rows: int) -> None:
    """The register tile does not divide most row counts; partial tiles must stay correct."""
    target = build_target(TargetSpec())
    k_dim, n_dim = 96, 80  # n not a multiple of the two-vector tile either
    t_var = te.var("T", "int64")
    a = te.placeholder((t_var, k_dim), name="A")
    w = te.placeholder((k_dim, n_dim), name="W")
    bias = te.placeholder((n_dim,), name="B")
    k = te.reduce_axis((0, k_dim), name="k")
    mm = te.compute((t_var, n_dim), lambda i, j: te.sum(a[i, k] * w[k, j], axis=k), name="matmul")
    out = te.compute((t_var, n_dim), lambda i, j: mm[i, j] + bias[j], name="bias_add")
    func = te.create_prim_func([a, w, bias, out], index_dtype_override="int64")
    sch = CPUMatmul().apply(func, target, False)
    assert sch is not None
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target)
    rng = np.random.default_rng(rows)
    args = [rng.standard_normal((rows, k_dim)), rng.standard_normal((k_dim, n_dim)), rng.standard_normal(n_dim)]
    args = [x.astype("float32") for x in args]
    result = tvm.runtime.tensor(np.zeros((rows, n_dim), "float32"))
    lib["main"](*[tvm.runtime.tensor(x) for x in args], result)
    np.testing.assert_allclose(result.numpy(), args[0] @ args[1] + args[2], rtol=1e-5, atol=1e-4)


def test_rules_decline_what_is_not_theirs() -> None:
    """A rule answers None for a function outside its pattern, so the next rule gets it."""
    target = build_target(TargetSpec())
    x = te.placeholder((te.var("n", "int64"), 16), name="x")
    y = te.compute(x.shape, lambda i, j: x[i, j] * 2.0, name="double")
    func = te.create_prim_func([x, y], index_dtype_override="int64")
    assert CPUMatmul().apply(func, target, False) is None
    chosen = [type(rule).__name__ for rule in cpu_schedule_rules() if rule.apply(func, target, False) is not None]
    assert chosen[0] == "ParallelInjective"
    assert isinstance(s_tir.Schedule(func), s_tir.Schedule)


def _layer_norm_func(width: int):
    rows = te.var("T", "int64")
    x = te.placeholder((rows, width), name="x")
    gamma, beta = te.placeholder((width,), name="gamma"), te.placeholder((width,), name="beta")
    out = topi.nn.layer_norm(x, gamma, beta, axis=[1], epsilon=1e-12)
    return te.create_prim_func([x, gamma, beta, out], index_dtype_override="int64")


@pytest.mark.parametrize("width", [768, 40, 24])
def test_row_reductions_are_split_by_lane_and_exact(width: int) -> None:
    """Layer norm's sums run as vector partials where the row is a whole number of vectors
    (768; not 40 or 24 at 16 lanes), and the result matches numpy at any row count."""
    target = build_target(TargetSpec(mcpu="skylake-avx512"))
    sch = RowReduction().apply(_layer_norm_func(width), target, False)
    assert sch is not None
    script = sch.mod["main"].script()
    assert ("_rf_local" in script) == (width % 16 == 0 and width >= 32)
    if not llvm_cpu_has_features("avx512f", build_target(TargetSpec())):
        return  # built for an AVX-512 CPU: checked for structure only here
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target)
    rng = np.random.default_rng(width)
    gamma, beta = (rng.standard_normal(width).astype("float32") for _ in range(2))
    for rows in (1, 7, 300):
        x = (rng.standard_normal((rows, width)) * 3 + 1).astype("float32")
        result = tvm.runtime.tensor(np.zeros((rows, width), "float32"))
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(gamma), tvm.runtime.tensor(beta), result)
        x64 = x.astype(np.float64)
        expected = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-12) * gamma + beta
        np.testing.assert_allclose(result.numpy(), expected, rtol=0, atol=1e-5)


def test_small_shapes_run_a_serial_copy_exactly() -> None:
    """Each default-scheduled function gets a serial copy of its loop nest beside the parallel
    one, taken up to ``SERIAL_UP_TO_ELEMENTS`` output elements (a parallel launch costs more
    than a few rows' work): 768-wide layer-norm rows, 5 of them (3840 elements) serial, 6
    parallel; both match numpy either side of the bound. Reshapes, which Relax turns into views,
    and the dense layers (the matmul rule) keep their one schedule."""
    width = 768
    assert 5 * width <= SERIAL_UP_TO_ELEMENTS < 6 * width
    target = build_target(TargetSpec())
    module = tvm.IRModule({"main": _layer_norm_func(width)})
    with target:
        scheduled = cpu_default_schedule()(module)["main"]
    script = scheduled.script()
    assert script.count("T.parallel(") == 1 and _serial_branch(script), script
    lib = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target)
    rng = np.random.default_rng(0)
    gamma, beta = (rng.standard_normal(width).astype("float32") for _ in range(2))
    for rows in (1, 5, 6, 64):
        x = (rng.standard_normal((rows, width)) * 3 + 1).astype("float32")
        result = tvm.runtime.tensor(np.zeros((rows, width), "float32"))
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(gamma), tvm.runtime.tensor(beta), result)
        x64 = x.astype(np.float64)
        expected = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-12) * gamma + beta
        np.testing.assert_allclose(result.numpy(), expected, rtol=0, atol=1e-5, err_msg=f"rows={rows}")
    for name, func in _primfuncs(MINILM):
        if "matmul" in name or name.startswith("reshape"):
            assert not _serial_branch(func.script()), name
        elif name.startswith("layer_norm"):
            assert _serial_branch(func.script()), name


def _serial_branch(script: str) -> bool:
    """The script branches on its output size against ``SERIAL_UP_TO_ELEMENTS``."""
    return re.search(rf"<= (T\.int\d+\()?{SERIAL_UP_TO_ELEMENTS}\b", script) is not None


def _key_permute_func(heads: int, head_dim: int):
    """The model's keys: its third of the joint projection, ``[b, s, 3h, d] -> [b, h, d, s]``."""
    batch, seq = te.var("b", "int64"), te.var("s", "int64")
    x = te.placeholder((batch, seq, 3 * heads, head_dim), name="x")
    out = te.compute((batch, heads, head_dim, seq), lambda b, h, d, s: x[b, s, heads + h, d], name="keys")
    return te.create_prim_func([x, out], index_dtype_override="int64")


def test_transposing_copies_are_blocked_and_exact() -> None:
    """The keys' permute reads its input with a stride along the output's contiguous axis: the
    rule blocks it (the input's contiguous axis looped inside each vector of output rows) and it
    stays exact for every length, tails included; a copy that keeps its last axis is not
    blocked."""
    target = build_target(TargetSpec())
    heads, head_dim = 12, 64
    func = _key_permute_func(heads, head_dim)
    normalized = normalize_for_test(func, target)
    assert transposed_read_loop(*normalized) is not None
    batch, seq = te.var("b", "int64"), te.var("s", "int64")
    x = te.placeholder((batch, seq, 3 * heads, head_dim), name="x")
    queries = te.compute((batch, heads, seq, head_dim), lambda b, h, s, d: x[b, s, h, d], name="queries")
    assert transposed_read_loop(*normalize_for_test(te.create_prim_func([x, queries]), target)) is None

    sch = ParallelInjective().apply(func, target, False)
    assert sch is not None
    script = sch.mod["main"].script()
    assert script.count("T.parallel(") == 1 and "T.vectorized(" in script
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target)
    rng = np.random.default_rng(0)
    for batch_size, length in ((1, 1), (1, 7), (1, 16), (2, 17), (1, 31), (1, 129), (1, 512)):
        data = rng.standard_normal((batch_size, length, 3 * heads, head_dim)).astype("float32")
        result = tvm.runtime.tensor(np.zeros((batch_size, heads, head_dim, length), "float32"))
        lib["main"](tvm.runtime.tensor(data), result)
        expected = data[:, :, heads : 2 * heads, :].transpose(0, 2, 3, 1)
        np.testing.assert_array_equal(result.numpy(), expected, err_msg=f"batch={batch_size} seq={length}")


def test_the_models_key_permute_is_the_one_blocked_copy() -> None:
    target = build_target(TargetSpec())
    mod, _ = export_relax(BertModel(MINILM, PoolingOptions(normalize=True)), max_batch=4)
    with target:
        legalized = tvm.transform.Sequential([*fast_math_passes(), *legalize_passes()])(mod)
    blocked = []
    for gvar, func in legalized.functions_items():
        normalized = normalize_for_test(func, target) if isinstance(func, tirx.PrimFunc) else None
        if normalized is not None and transposed_read_loop(*normalized) is not None:
            blocked.append(gvar.name_hint)
    assert len(blocked) == 1 and "transpose" in blocked[0], blocked


def normalize_for_test(func: tirx.PrimFunc, target):
    """``func``'s schedule with its element-wise blocks inlined, and its one remaining block."""
    inlined = inlined_injective(func, target)
    if inlined is None or len(inlined[1]) != 1:
        return None
    return inlined[0], inlined[1][0].block_rv
