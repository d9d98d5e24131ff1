"""Attention's scores are served fused with their softmax (``compile/passes/fuse_softmax.py``), so
they are tuned that way: the task file marks them, and the tuner builds, checks and times each
candidate with the softmax in it, against TVM's unscheduled scores softmaxed by numpy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tvm

from dietserve.compile.passes.fuse_softmax import softmaxed_operators
from dietserve.kernels.apply import apply_variant
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.plan.task_file import TaskDescription, TaskFileError
from dietserve.kernels.tir.matching import is_dynamic_matmul, matmul_axes
from tuner.extract import spec_from_prim_func
from tuner.measure.job import MeasureJob
from tuner.measure.runner import LocalRunner, MeasureOptions
from tuner.measure.timing import TimingPolicy
from tuner.ops import from_recipe, random_inputs

TARGET = {"kind": "llvm", "num-cores": 2}
CLAMPED = MicroKernel(tile=(("i", (4, 2)), ("j", (16,)), ("k", (1,))), vector=8, cache_scopes=("clamped",))
SHAPE = {"batch": 1, "seq_len": 29}


@pytest.fixture(scope="module")
def scores(legalized_minilm: tvm.IRModule) -> tuple[str, tvm.tirx.PrimFunc]:
    (name,) = softmaxed_operators(legalized_minilm)  # the one operator feeding a softmax alone
    return name, legalized_minilm[name]


def test_the_scores_alone_are_found_feeding_a_softmax(scores) -> None:
    name, func = scores
    axes = matmul_axes(func)
    assert is_dynamic_matmul(func) and axes["i"] == axes["j"] == "seq_len", (name, axes)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_a_softmaxed_spec_is_checked_against_the_softmaxed_reference(scores) -> None:
    name, func = scores
    fused, plain = spec_from_prim_func(name, func, row_softmax=True), spec_from_prim_func(name, func)
    assert fused.name == plain.name + "+softmax"  # its records are another workload's
    assert from_recipe(fused.recipe).row_softmax and not from_recipe(plain.recipe).row_softmax
    inputs = random_inputs(fused, SHAPE)
    expected = fused.expected(SHAPE, inputs)
    np.testing.assert_allclose(expected, _softmax(plain.expected(SHAPE, inputs).astype("float64")),
                               rtol=1e-5, atol=1e-6)
    target = tvm.target.Target(TARGET)
    for row_softmax in (True, False):
        lib = tvm.compile(apply_variant(fused.func, CLAMPED, target, row_softmax=row_softmax), target)
        out = tvm.runtime.tensor(np.full(expected.shape, np.nan, "float32"))
        lib(*fused.call_arguments(SHAPE, [tvm.runtime.tensor(x) for x in inputs], out))
        assert np.allclose(out.numpy(), expected, rtol=1e-3, atol=1e-3) == row_softmax


def test_the_worker_times_the_scores_with_their_softmax(scores) -> None:
    name, func = scores
    spec = spec_from_prim_func(name, func, row_softmax=True)
    job = MeasureJob(recipe=spec.recipe, target=TARGET, shapes=(SHAPE,), check_shape={"batch": 1, "seq_len": 13},
                     kernel=CLAMPED.to_json())
    with LocalRunner(MeasureOptions(timing=TimingPolicy(number=1, repeat=1, min_repeat_ms=1), workers=1)) as runner:
        tuned = runner.run(job)
        default = runner.run(replace(job, kernel=None))
        custom = runner.run(replace(job, apply="tests.unit.test_tuner_measure:wrong_schedule"))
    for result in (tuned, default):  # (checked against the softmaxed reference first)
        assert result.ok, result.traceback
        assert result.latency > 0
    assert "cannot fuse the softmax" in custom.error


def test_a_task_file_says_whether_an_operator_is_softmaxed() -> None:
    base = {"workload": "w", "operator": "op", "calls": 6, "func": "{}", "vary": {"var": "seq_len", "values": [1, 2]}}
    assert TaskDescription(**base).softmax is False  # absent: false (files written before the flag)
    assert TaskDescription(**base, softmax=True).softmax is True
    with pytest.raises(TaskFileError, match="softmax must be true or false"):
        TaskDescription(**base, softmax="yes")


def test_softmax_exp_is_fast_exps_values_where_its_input_is_not_positive() -> None:
    """The attention and fused softmax's exp drops fast_exp's upper clamp and final max, which
    change nothing for x <= 0: the same bits there, on every float32 kind of input."""
    import numpy as np
    import tvm
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    from dietserve.kernels.tir.fast_exp import fast_exp, softmax_exp

    rng = np.random.default_rng(0)
    values = np.concatenate([-rng.exponential(5, 4080).astype(np.float32),
                             np.float32([0, -0.0, -1e-30, -1e-45, -88.37, -88.38, -100, -3.4e38] * 2)])

    def run(exp) -> np.ndarray:
        with IRBuilder() as builder:
            with T.prim_func():
                T.func_name("main")
                x = T.arg("x", T.buffer((values.size,), "float32"))
                y = T.arg("y", T.buffer((values.size,), "float32"))
                with T.serial(0, values.size // 16) as i:
                    with T.vectorized(0, 16) as lane:
                        T.buffer_store(y, exp(x[i * 16 + lane]), [i * 16 + lane])
        out = tvm.runtime.tensor(np.zeros_like(values))
        tvm.compile(builder.get(), tvm.target.Target({"kind": "llvm"}))(tvm.runtime.tensor(values), out)
        return out.numpy()

    ours, topi = run(softmax_exp), run(fast_exp)
    np.testing.assert_array_equal(ours.view(np.uint32), topi.view(np.uint32))
    np.testing.assert_allclose(ours, np.exp(values.astype(np.float64)), rtol=5e-6, atol=1e-38)  # (TOPI's error)
