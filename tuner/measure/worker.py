"""Inside a measurement worker process: build one candidate, check it against numpy on a sample
shape, time it on each requested shape. Everything that can crash or hang (TVM's compiler,
generated code) runs here, never in the tuner's own process."""

from __future__ import annotations

from dietserve.host.startup import keep_torch_out

if __name__ == "__main__":  # a worker process: before TVM is imported
    keep_torch_out()

import importlib
import os
import pickle
import tempfile
import time
import traceback
from collections import OrderedDict
from functools import lru_cache

import numpy as np

from .job import DEFAULT_APPLY, MeasureResult, WorkerJob, build_key

CHECK_RTOL = 1e-3
CHECK_ATOL = 1e-3
# A tensor-core kernel rounds the product's two operands to fp16: it is checked against numpy on
# the same rounded operands (then only the order of the fp32 sums differs), with this bar.
MMA_CHECK_TOLERANCE = 1e-2


@lru_cache(maxsize=16)
def _spec(recipe: tuple):
    from ..ops import from_recipe

    return from_recipe(recipe)


@lru_cache(maxsize=8)
def _inputs(recipe: tuple, shape_key: tuple) -> list[np.ndarray]:
    from ..ops import random_inputs

    return random_inputs(_spec(recipe), dict(shape_key), seed=len(shape_key) + sum(v for _, v in shape_key))


@lru_cache(maxsize=8)
def _kernel_inputs(recipe: tuple, shape_key: tuple, pack: int) -> list[np.ndarray]:
    from ..ops import kernel_inputs

    return kernel_inputs(_spec(recipe), _inputs(recipe, shape_key), pack)


@lru_cache(maxsize=8)
def _expected(recipe: tuple, shape_key: tuple, operands: str = "fp32") -> np.ndarray:
    """The operator's result on the sample shape, its product's operands (first among the inputs,
    ``ops``) rounded as the kernel reads them: ``fp16`` (tensor cores) or ``bf16``."""
    from ..ops import rounded_operands

    inputs = _inputs(recipe, shape_key)
    if operands != "fp32":
        inputs = rounded_operands(inputs, operands)
    return _spec(recipe).expected(dict(shape_key), inputs)


def _freeze(value):
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


class _Connection:
    """Where the compiled candidate runs: this process's device, or a remote one over TVM RPC."""

    def __init__(self, config: dict, target_kind: str, threads: int | None):
        import tvm

        self.remote, self.uploads = None, 0
        if config["kind"] == "rpc":
            tracker = tvm.rpc.connect_tracker(config["host"], int(config["port"]))
            self.remote = tracker.request(config["key"], priority=int(config.get("priority", 1)),
                                          session_timeout=int(config.get("session_timeout", 60)))
        where = tvm if self.remote is None else self.remote
        self.device = where.cuda(0) if target_kind == "cuda" else where.cpu(0)
        if self.remote is None and target_kind == "llvm":
            # As many threads as the served model runs kernels on: TVM's default pool has half the
            # cores on x86, which made serial kernels look as fast as parallel ones.
            from dietserve.host.cpu import configure_cpu_threads

            configure_cpu_threads(threads)

    def load(self, executable):
        if self.remote is None:
            return executable.jit()
        # A fresh name each: the RPC connection outlives jobs, and dlopen of a path
        # loaded before returns the old library.
        self.uploads += 1
        name = f"candidate-{os.getpid()}-{self.uploads}.so"
        with tempfile.TemporaryDirectory(prefix="dietserve-tuner-") as folder:
            executable.export_library(os.path.join(folder, name))
            self.remote.upload(os.path.join(folder, name))
        return self.remote.load_module(name)

    def tensor(self, array: np.ndarray):
        import tvm

        return tvm.runtime.tensor(array, device=self.device)


# One connection per device for the worker's life, so an RPC connection is requested once, not per job.
_CONNECTIONS: dict[tuple, _Connection] = {}
# Candidates built and checked, the most recently used ``WorkerJob.builds_kept``: a kernel is
# symbolic in the shape, so one build serves every shape it is timed on.
_BUILDS: OrderedDict[str, object] = OrderedDict()


def _failure(err: Exception) -> MeasureResult:
    return MeasureResult.failed(f"{type(err).__name__}: {err}", traceback.format_exc(limit=8)[-2000:])


def measure(work: WorkerJob) -> MeasureResult:
    """Build, check and time one candidate; never raises. A job that raised forgets the connections and
    builds: the remote end may be what failed."""
    try:
        return _measure(work, time.perf_counter())
    except Exception as err:  # noqa: BLE001 - a failing candidate is a result, not a crash
        _CONNECTIONS.clear()
        _BUILDS.clear()
        return _failure(err)


def compile_only(work: WorkerJob) -> MeasureResult:
    """Compile the job's candidate into a library at ``work.compile_to`` and stop: a builder never
    runs a kernel, so its thread pool never spins while the timing worker times. Never raises."""
    started = time.perf_counter()
    try:
        compiled(work, _spec(_freeze(work.job.recipe))).export_library(work.compile_to)
    except Exception as err:  # noqa: BLE001 - a failing candidate is a result, not a crash
        return _failure(err)
    return MeasureResult(build_seconds=time.perf_counter() - started)


def compiled(work: WorkerJob, spec):
    """The job's candidate scheduled and compiled (not loaded, not run)."""
    import tvm

    from dietserve.kernels.apply import apply_default, apply_variant
    from dietserve.kernels.plan.microkernel import MicroKernel
    from dietserve.kernels.tir.build import build

    job = work.job
    device_target = {name: value for name, value in job.target.items() if name != "host"}
    target = tvm.target.Target(device_target, host=job.target.get("host") or None)
    kernel = None if job.kernel is None else MicroKernel.from_json(job.kernel)
    if spec.row_softmax:  # served with the softmax fused in: built as the link pass builds it
        if job.apply != DEFAULT_APPLY:
            raise ValueError(f"{job.apply} cannot fuse the softmax this operator is served with")
        scheduled = apply_variant(spec.func, kernel, target, job.loop_partition, row_softmax=True)
    elif kernel is None:  # the default rule's kernel: what an untuned build runs
        scheduled = apply_default(spec.func, target)
    else:  # given the target, as the model's build gives it: a CPU kernel's tasks fit its cores
        scheduled = resolve(job.apply)(spec.func, kernel, target, job.loop_partition)
    return build(scheduled, target)


def _built_and_checked(work: WorkerJob, spec, recipe: tuple, connection: _Connection, kernel):
    """(the candidate compiled, loaded and checked on the sample shape, whether it was kept from
    before); or the error message of a wrong one (not kept)."""
    import tvm

    from dietserve.kernels.plan.microkernel import WMMA_F16

    key = build_key(work)
    if key in _BUILDS:
        _BUILDS.move_to_end(key)
        return _BUILDS[key], True
    # ``work.library``: compiled by a builder worker (``compile_only``; local only)
    module = tvm.runtime.load_module(work.library) if work.library else connection.load(compiled(work, spec))
    check_key = tuple(sorted(work.job.check_shape.items()))
    # (fp16: CUDA tensor cores; bf16: a bf16 build's packed kernels, AMX tiles among them)
    pack, mma = (0, False) if kernel is None else (kernel.pack, kernel.mma == WMMA_F16)
    expected = _expected(recipe, check_key, "fp16" if mma else "bf16" if pack and spec.precision == "bf16" else "fp32")
    tolerance = (MMA_CHECK_TOLERANCE,) * 2 if mma else (CHECK_RTOL, CHECK_ATOL)
    output = connection.tensor(np.full(expected.shape, np.nan, "float32"))
    inputs = [connection.tensor(x) for x in _kernel_inputs(recipe, check_key, pack)]
    module["main"](*spec.call_arguments(dict(check_key), inputs, output))
    got = output.numpy()
    if not np.allclose(got, expected, rtol=tolerance[0], atol=tolerance[1]):
        worst = float(np.nanmax(np.abs(got - expected))) if np.isfinite(got).any() else float("nan")
        return f"wrong result on {dict(check_key)}: max abs error {worst:.3g}"
    _BUILDS[key] = module
    while len(_BUILDS) > work.builds_kept:
        _BUILDS.popitem(last=False)
    return module, False


def _measure(work: WorkerJob, started: float) -> MeasureResult:
    from dietserve.host.cpu import target_cores
    from dietserve.kernels.plan.microkernel import MicroKernel

    job, recipe = work.job, _freeze(work.job.recipe)
    spec = _spec(recipe)
    key = (tuple(sorted(work.device.items())), job.target["kind"], target_cores(job.target))
    if key not in _CONNECTIONS:
        _CONNECTIONS[key] = _Connection(dict(work.device), job.target["kind"], key[2])
    connection = _CONNECTIONS[key]
    kernel = None if job.kernel is None else MicroKernel.from_json(job.kernel)
    pack = 0 if kernel is None else kernel.pack
    outcome = _built_and_checked(work, spec, recipe, connection, kernel)
    if isinstance(outcome, str):  # a wrong result
        return MeasureResult.failed(outcome)
    (module, reused), build_seconds = outcome, time.perf_counter() - started
    if work.build_only:  # built ahead (``LocalRunner.prepare``): timed by a later job
        return MeasureResult(build_seconds=build_seconds, build_reused=reused)
    latencies = []
    for shape in job.shapes:
        arrays = [connection.tensor(x) for x in _kernel_inputs(recipe, tuple(sorted(shape.items())), pack)]
        output = connection.tensor(np.empty(spec.output_shape(dict(shape)), "float32"))
        arguments = spec.call_arguments(dict(shape), arrays, output)
        latencies.append(work.timing.time(module, connection.device, arguments, job.abandon_above_s,
                                          local=connection.remote is None))
    return MeasureResult(latencies=tuple(latencies), build_seconds=build_seconds, build_reused=reused)


def resolve(path: str):
    """``"package.module:function"`` -> the function that applies a micro-kernel (custom schedules)."""
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"schedule function must look like 'package.module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


def write_frame(stream, message) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(payload).to_bytes(8, "little") + payload)
    stream.flush()


def main() -> None:
    """One ``WorkerJob`` frame in on stdin, one ``MeasureResult`` frame out, until EOF. The protocol
    owns the original stdout; anything else printing (TVM, nvcc) goes to stderr."""
    from . import worker  # run as ``-m`` this file is ``__main__``: jobs share the imported module's caches

    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    protocol_in = os.fdopen(0, "rb")
    while len(header := protocol_in.read(8)) == 8:
        work = pickle.loads(protocol_in.read(int.from_bytes(header, "little")))
        write_frame(protocol_out, worker.compile_only(work) if work.compile_to else worker.measure(work))


if __name__ == "__main__":
    main()
