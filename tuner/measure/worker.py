"""What runs inside a measurement worker process: build one candidate, check it against numpy on
a sample shape, then time it on each requested shape (``timing.TimingPolicy``).

Jobs and results are frozen values (``job.py``) pickled over the process pipe. Everything that
can crash or hang (TVM's compiler, generated code) runs here, never in the tuner's own process.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a worker process, started by ``runner.py``: before TVM is imported
    # tvm_ffi imports torch wherever it is installed; no job uses it, and the import is most of
    # a worker's start.
    sys.modules.setdefault("torch", None)

import os
import pickle
import tempfile
import time
import traceback
from collections import OrderedDict
from functools import lru_cache

import numpy as np

from .job import MeasureResult, WorkerJob, build_key

CHECK_RTOL = 1e-3
CHECK_ATOL = 1e-3


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
def _expected(recipe: tuple, shape_key: tuple) -> np.ndarray:
    return _spec(recipe).expected(dict(shape_key), _inputs(recipe, shape_key))


def _freeze(value):
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


class _Session:
    """Where the compiled candidate runs: this process's device, or a remote one over TVM RPC."""

    def __init__(self, device_config: dict, target_kind: str, threads: int | None):
        self.config = device_config
        self.remote = None
        self.uploads = 0
        if device_config["kind"] == "rpc":
            from tvm import rpc

            tracker = rpc.connect_tracker(device_config["host"], int(device_config["port"]))
            self.remote = tracker.request(device_config["key"], priority=int(device_config.get("priority", 1)),
                                          session_timeout=int(device_config.get("session_timeout", 60)))
            self.device = self.remote.cuda(0) if target_kind == "cuda" else self.remote.cpu(0)
        else:
            import tvm

            self.device = tvm.cuda(0) if target_kind == "cuda" else tvm.cpu(0)
            if target_kind == "llvm":
                # Time kernels on as many threads as the served model runs them on (the engine
                # sizes the pool the same way); TVM's default pool has half the cores on x86,
                # which made serial kernels look as fast as parallel ones.
                from dietserve.host.cpu import configure_cpu_threads

                configure_cpu_threads(threads)

    def load_library(self, path: str):
        """A candidate another worker compiled (``compile_only``); local only."""
        import tvm

        return tvm.runtime.load_module(path)

    def load(self, executable):
        if self.remote is None:
            return executable.jit()
        # A fresh name per candidate: the session outlives jobs, and dlopen of a path it has
        # already loaded returns the old library.
        self.uploads += 1
        name = f"candidate-{os.getpid()}-{self.uploads}.so"
        with tempfile.TemporaryDirectory(prefix="dietserve-tuner-") as folder:
            path = os.path.join(folder, name)
            executable.export_library(path)
            self.remote.upload(path)
        return self.remote.load_module(name)

    def tensor(self, array: np.ndarray):
        import tvm

        return tvm.runtime.tensor(array, device=self.device)


_SESSIONS: dict[tuple, _Session] = {}


def _session(device_config: dict, target_kind: str, threads: int | None = None) -> _Session:
    """One session per device for the worker's life: an RPC session is requested from the
    tracker once, not per candidate (a failed job drops it, see ``measure``)."""
    key = (tuple(sorted(device_config.items())), target_kind, threads)
    if key not in _SESSIONS:
        _SESSIONS[key] = _Session(device_config, target_kind, threads)
    return _SESSIONS[key]


def measure(work: WorkerJob) -> MeasureResult:
    """Build, check and time one candidate; never raises (errors are in the result). A job that
    raised forgets the sessions and builds: the remote end may be what failed."""
    started = time.perf_counter()
    try:
        return _measure(work, started)
    except Exception as err:  # noqa: BLE001 - a failing candidate is a result, not a crash
        _SESSIONS.clear()
        _BUILDS.clear()
        return MeasureResult.failed(f"{type(err).__name__}: {err}", time.perf_counter() - started,
                                    traceback.format_exc(limit=8)[-2000:])


# Candidates built and checked, kept for the worker's life (the most recently used): a kernel is
# symbolic in the shape, so one build serves every shape it is timed on. A job says how many
# (``WorkerJob.builds_kept``: as many as its tune builds).
_BUILDS: OrderedDict[str, object] = OrderedDict()


def _compiled(work: WorkerJob, spec):
    """The job's candidate scheduled and compiled (not loaded, not run)."""
    import tvm

    from dietserve.kernels.apply import apply_default, apply_variant
    from dietserve.kernels.plan.microkernel import MicroKernel
    from dietserve.kernels.tir.build import build

    from .job import DEFAULT_APPLY

    job = work.job
    host = job.target.get("host")
    device_target = {name: value for name, value in job.target.items() if name != "host"}
    target = tvm.target.Target(device_target, host=host) if host else tvm.target.Target(device_target)
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


def compile_only(work: WorkerJob) -> MeasureResult:
    """Compile the job's candidate into a shared library at ``work.compile_to`` and stop: a
    builder worker never runs a kernel, so its TVM thread pool never spins on the cores while
    the timing worker times. Never raises."""
    started = time.perf_counter()
    try:
        _compiled(work, _spec(_freeze(work.job.recipe))).export_library(work.compile_to)
        return MeasureResult(library=work.compile_to, build_seconds=time.perf_counter() - started)
    except Exception as err:  # noqa: BLE001 - a failing candidate is a result, not a crash
        return MeasureResult.failed(f"{type(err).__name__}: {err}", time.perf_counter() - started,
                                    traceback.format_exc(limit=8)[-2000:])


def _built_and_checked(work: WorkerJob, spec, recipe: tuple, session: _Session, pack: int):
    """(the job's candidate compiled, loaded and checked on the sample shape, whether it was kept
    from before); or the error message of a wrong one (not kept)."""
    key = build_key(work)
    if key in _BUILDS:
        _BUILDS.move_to_end(key)
        return _BUILDS[key], True
    module = session.load_library(work.library) if work.library else session.load(_compiled(work, spec))
    # Correctness first: on the sample shape, against the independent reference.
    check_key = tuple(sorted(work.job.check_shape.items()))
    inputs = _kernel_inputs(recipe, check_key, pack)
    expected = _expected(recipe, check_key)
    output = session.tensor(np.full(expected.shape, np.nan, "float32"))
    module["main"](*spec.call_arguments(dict(check_key), [session.tensor(x) for x in inputs], output))
    got = output.numpy()
    if not np.allclose(got, expected, rtol=CHECK_RTOL, atol=CHECK_ATOL):
        worst = float(np.nanmax(np.abs(got - expected))) if np.isfinite(got).any() else float("nan")
        return f"wrong result on {dict(check_key)}: max abs error {worst:.3g}"
    _BUILDS[key] = module
    while len(_BUILDS) > work.builds_kept:
        _BUILDS.popitem(last=False)
    return module, False


def _measure(work: WorkerJob, started: float) -> MeasureResult:
    from dietserve.host.cpu import target_cores
    from dietserve.kernels.plan.microkernel import MicroKernel

    job, timing = work.job, work.timing
    recipe = _freeze(job.recipe)
    spec = _spec(recipe)
    session = _session(dict(work.device), job.target["kind"], target_cores(job.target))
    pack = 0 if job.kernel is None else MicroKernel.from_json(job.kernel).pack
    outcome = _built_and_checked(work, spec, recipe, session, pack)
    if isinstance(outcome, str):  # a wrong result
        return MeasureResult.failed(outcome, time.perf_counter() - started)
    module, reused = outcome
    built = time.perf_counter()
    if work.build_only:  # built ahead (``LocalRunner.prepare``): timed by a later job
        return MeasureResult(build_seconds=built - started, build_reused=reused, seconds=built - started)
    latencies = []
    for shape in job.shapes:
        arrays = _kernel_inputs(recipe, tuple(sorted(shape.items())), pack)
        output = session.tensor(np.empty(spec.output_shape(dict(shape)), "float32"))
        arguments = spec.call_arguments(dict(shape), [session.tensor(x) for x in arrays], output)
        latencies.append(timing.time(module, session.device, arguments, job.abandon_above_s,
                                     local=session.remote is None))
    return MeasureResult(latencies=tuple(latencies), build_seconds=built - started, build_reused=reused,
                         seconds=time.perf_counter() - started)


def resolve(path: str):
    """``"package.module:function"`` -> the function that applies a micro-kernel (custom schedules)."""
    import importlib

    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"schedule function must look like 'package.module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


def _read_frame(stream) -> object | None:
    header = stream.read(8)
    if len(header) < 8:
        return None
    payload = stream.read(int.from_bytes(header, "little"))
    return pickle.loads(payload)


def write_frame(stream, message) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(payload).to_bytes(8, "little") + payload)
    stream.flush()


def main() -> None:
    """The worker loop over stdin/stdout frames: one ``WorkerJob`` in, one ``MeasureResult`` out,
    until EOF. The protocol owns the original stdout; anything else printing (TVM, nvcc) goes
    to stderr."""
    # Run as ``-m``, this file is ``__main__``: the jobs go through the imported module, whose
    # builds and sessions every job shares.
    from . import worker

    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    protocol_in = os.fdopen(0, "rb")
    while True:
        work = _read_frame(protocol_in)
        if work is None:
            return
        write_frame(protocol_out, worker.compile_only(work) if work.compile_to else worker.measure(work))


if __name__ == "__main__":
    main()
