"""Tasks taken at run time (``dietserve/kernels/cpu_packed/claimed_tasks.py``): every task runs, none more
than twice, a slow worker's tasks are taken by the others, and the packed GEMM kernels built so
match numpy at every length."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from dietserve.host.cpu import configure_cpu_threads, target_cores
from dietserve.kernels.apply import apply_variant
from dietserve.kernels.cpu_packed.claimed_tasks import claimed_tasks
from dietserve.kernels.cpu_packed.packing import pack_array
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.tir.build import build
from tuner.ops import dense, random_inputs

from .kernel_builds import build_each
from .test_packed_kernels import SHAPES, fitting_space

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
# A slowed worker's extra work per task (volatile adds): enough that its own share lasts long
# past the other worker's thread start, even on a busy machine; with much less, the slow worker
# can run every task before the other has started.
SPIN_STEPS = 2_000_000


def counting_kernel(extent: int, workers: int, slow_worker: int | None = None):
    """A kernel whose task ``t`` adds 1 to ``runs[t]`` and writes its worker to ``by[t]``; where
    ``slow_worker`` is set, that worker also spins ``SPIN_STEPS`` steps in each of its tasks."""
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name("main")
            runs = T.arg("runs", T.Buffer((extent,), "int32"))
            by = T.arg("by", T.Buffer((extent,), "int32"))
            spin = T.alloc_buffer((1,), "int32", annotations={"tirx.volatile": True})
            with claimed_tasks(extent, workers) as claim:
                T.buffer_store(runs, runs[claim.task] + 1, [claim.task])
                T.buffer_store(by, claim.worker, [claim.task])
                if slow_worker is not None:
                    with T.If(claim.worker == slow_worker):
                        with T.Then():
                            with T.serial(0, SPIN_STEPS):
                                T.buffer_store(spin, spin[0] + 1, [0])
    return build(tvm.IRModule({"main": builder.get()}), TARGET)["main"]


def run_counting(function, extent: int) -> tuple[np.ndarray, np.ndarray]:
    runs = tvm.runtime.tensor(np.zeros(extent, "int32"))
    by = tvm.runtime.tensor(np.full(extent, -1, "int32"))
    function(runs, by)
    return runs.numpy(), by.numpy()


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
@pytest.mark.parametrize("extent", [1, 2, 3, 7, 64, 1001])
def test_every_task_runs_once_or_twice_where_two_workers_meet(extent: int, workers: int) -> None:
    configure_cpu_threads(2)
    function = counting_kernel(extent, workers)
    for _ in range(20):
        runs, by = run_counting(function, extent)
        assert runs.min() >= 1, f"tasks never run: {np.flatnonzero(runs == 0)}"
        assert runs.max() <= 2, f"tasks run more than twice: {np.flatnonzero(runs > 2)}"
        assert (runs == 2).sum() <= workers  # at most where an owner and its helper meet
        assert ((by >= 0) & (by < min(workers, extent))).all()


def test_a_slow_workers_tasks_are_taken_by_the_other() -> None:
    """Worker 0 spins in each of its tasks: worker 1 runs its own half, then takes most of worker
    0's from the back, where TVM's even split would leave them all to worker 0."""
    configure_cpu_threads(2)
    extent = 64
    runs, by = run_counting(counting_kernel(extent, 2, slow_worker=0), extent)
    assert runs.min() >= 1 and runs.max() <= 2
    first_half_by_worker_1 = int((by[: extent // 2] == 1).sum())
    assert (by[extent // 2:] == 1).all()  # its own segment, from the front
    assert first_half_by_worker_1 >= extent // 4, by  # and most of the slow one's, from the back
    taken = np.flatnonzero(by[: extent // 2] == 1)
    assert (taken == np.arange(extent // 2 - len(taken), extent // 2)).all(), by  # a run at its back


@pytest.mark.parametrize("workers", [2, 3])
def test_every_packed_kernel_with_claimed_tasks_matches_numpy(workers: int) -> None:
    """The fitting packed kernels (whole and blocked reductions) built with claimed tasks: the
    output starts as NaN, so a task left out shows."""
    configure_cpu_threads(2)
    spec = dense(96, 144, "bias_gelu")
    kernels = fitting_space(spec)
    blocked = MicroKernel(tile=(("i", (4,)), ("j", (24, 1, 2)), ("k", (32,))), vector=8, pack=24)
    kernels.append(blocked)
    where = tvm.target.Target({"kind": "llvm", "num-cores": workers})  # its cores: the workers
    functions = build_each(spec.func, kernels, TARGET, where)
    for index, kernel in enumerate(kernels):
        for length in SHAPES:
            inputs = random_inputs(spec, {"T": length}, seed=length)
            arguments = [pack_array(x, kernel.pack) if i == 1 else x for i, x in enumerate(inputs)]
            out = tvm.runtime.tensor(np.full(spec.output_shape({"T": length}), np.nan, "float32"))
            functions[index](*[tvm.runtime.tensor(x) for x in arguments], out)
            np.testing.assert_allclose(out.numpy(), spec.reference(*inputs), rtol=1e-4, atol=1e-4,
                                       err_msg=f"{kernel} T={length} workers={workers}")


def test_the_target_cores_decide_the_workers() -> None:
    """A CPU target naming its cores builds claimed tasks (volatile counters in the code); one
    naming none keeps TVM's even split."""
    spec = dense(96, 144, "bias")
    kernel = fitting_space(spec)[0]
    with_cores = apply_variant(spec.func, kernel, TARGET)
    without = apply_variant(spec.func, kernel, tvm.target.Target({"kind": "llvm"}))
    assert "tirx.volatile" in with_cores.script()
    assert "tirx.volatile" not in without.script()
    # The same cores read from a target's description (a manifest's, a tuning job's).
    assert target_cores(TARGET) == target_cores({"kind": "llvm", "num-cores": "2"}) == 2
    assert target_cores({"kind": "llvm"}) is None and target_cores({"kind": "cuda", "num-cores": 2}) is None


def test_the_tuner_times_kernels_built_as_the_model_builds_them() -> None:
    """The tuner's worker builds a candidate with the target's cores as workers, as the model's
    compile does (``apply_variant``): what is timed is what is served."""
    from tuner.measure.job import MeasureJob, WorkerJob
    from tuner.measure.worker import _freeze, _spec, compiled

    spec = dense(96, 144, "bias")
    kernel = fitting_space(spec)[0]
    job = MeasureJob(recipe=spec.recipe, target={"kind": "llvm", "num-cores": 2}, kernel=kernel.to_json(),
                     shapes=({"T": 7},), check_shape={"T": 7})
    tuned = compiled(WorkerJob(job), _spec(_freeze(job.recipe))).mod.inspect_source("ll")
    served = build(apply_variant(spec.func, kernel, TARGET), TARGET).mod.inspect_source("ll")
    assert "load volatile" in tuned and "load volatile" in served
