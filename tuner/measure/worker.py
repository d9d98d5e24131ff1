"""What runs inside a measurement worker process: build one candidate, check it against the
reference on a sample shape, then time it on each requested shape (or race several on one
shape: ``racing.py``).

A job and its result are plain dicts (they cross a process pipe). Everything that can crash or
hang (TVM's compiler, generated code) runs here, never in the tuner's own process.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a worker process, started by ``runner.py``: before TVM is imported
    # tvm_ffi imports torch wherever it is installed (its guard against a symbol clash on
    # Windows). No job uses it, and it was 4.5 s of a worker's 6 s start on a 2-core host: paid
    # by every tune, every operator the benchmark tunes, and every worker restarted after a crash.
    sys.modules.setdefault("torch", None)

import os
import pickle
import tempfile
import time
import traceback
from collections import OrderedDict
from functools import lru_cache

import numpy as np

from dietserve.kernels.hardware import last_level_cache_bytes
from dietserve.kernels.huge_pages import on_huge_pages

from .beside import reference_kernel, time_beside_reference
from .host_load import OtherLoad
from .streaming import copies, time_streaming

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
        self.kept: dict[tuple, list] = {}  # (recipe, packing) -> weight copies (``_weight_copies``)
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
                from dietserve.kernels.host import configure_cpu_threads

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


def measure(job: dict) -> dict:
    """Build, check and time one micro-kernel; never raises (errors are in the result)."""
    return never_raises(_measure, job)


def never_raises(body, job: dict) -> dict:
    """``body(job, started)``'s result, or the error result of a job that raised, after forgetting
    the session and the builds: the remote end may be what failed (reconnect for the next job),
    and modules loaded there go with it. A failing job is a result, not a crash."""
    started = time.perf_counter()
    try:
        return body(job, started)
    except Exception as err:  # noqa: BLE001 - a failing candidate or race is a result, not a crash
        _SESSIONS.clear()
        _BUILDS.clear()
        return {"error": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc(limit=8)[-2000:],
                "seconds": time.perf_counter() - started}


# Candidates built and checked, kept for the worker's life (the most recently used): a kernel
# is symbolic in the shape, so one build serves every shape it is timed on (the default rule's
# kernel on each shape the search works on, a plan's variant at its interval's ends and middle).
# As many as a tune of 64 trials builds: the races come last, and with 16 kept their finalists
# built early had been evicted and were built again, serially, inside the races. A job may ask
# for more (``builds_kept``: ``MeasureOptions.for_trials``, a longer tune). A jitted AVX-512
# candidate of bert-base's 3072 -> 768 layer holds about 3 MiB (ad hoc, 12 kept).
BUILDS_KEPT = 64
_BUILDS: OrderedDict[str, object] = OrderedDict()


def build_key(job: dict) -> str:
    """What decides the compiled module and its check: everything of the job but the shapes
    timed and how they are timed."""
    return repr([job["recipe"], sorted(job["target"].items()), job["kernel"], job.get("apply"),
                 job.get("loop_partition", False), sorted(job["device"].items()), sorted(job["check_shape"].items())])


def _compiled(job: dict, spec):
    """The job's candidate scheduled and compiled (not loaded, not run)."""
    import tvm

    from dietserve.kernels.apply import apply_default
    from dietserve.kernels.build import build
    from dietserve.kernels.microkernel import MicroKernel

    host = job["target"].get("host")
    device_target = {name: value for name, value in job["target"].items() if name != "host"}
    target = tvm.target.Target(device_target, host=host) if host else tvm.target.Target(device_target)
    if spec.row_softmax:  # served with the softmax fused in: built as the link pass builds it
        from dietserve.kernels.apply import apply_variant

        from ..options import DEFAULT_APPLY

        if job.get("apply", DEFAULT_APPLY) != DEFAULT_APPLY:
            raise ValueError(f"{job['apply']} cannot fuse the softmax this operator is served with")
        kernel = None if job["kernel"] is None else MicroKernel.from_json(job["kernel"])
        scheduled = apply_variant(spec.func, kernel, target, job.get("loop_partition", False), row_softmax=True)
    elif job["kernel"] is None:  # the default rule's kernel: what an untuned build runs
        scheduled = apply_default(spec.func, target)
    else:
        kernel = MicroKernel.from_json(job["kernel"])
        # Given the target, as the model's build gives it: a CPU kernel's tasks are taken by its cores.
        scheduled = resolve(job["apply"])(spec.func, kernel, target, job.get("loop_partition", False))
    return build(scheduled, target)


def compile_only(job: dict) -> dict:
    """Compile the job's candidate into a shared library at ``job["compile_to"]`` and stop: a
    builder worker (``LocalRunner.prepare``) never runs a kernel, so its TVM thread pool never
    starts (an idle pool's threads spin on the cores for a while after each parallel call, and
    kernels timed meanwhile in another process ran up to 3x slower). Never raises."""
    started = time.perf_counter()
    try:
        _compiled(job, _spec(_freeze(job["recipe"]))).export_library(job["compile_to"])
        return {"error": None, "library": job["compile_to"], "build_seconds": time.perf_counter() - started}
    except Exception as err:  # noqa: BLE001 - a failing candidate is a result, not a crash
        return {"error": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc(limit=8)[-2000:],
                "seconds": time.perf_counter() - started}


def _built_and_checked(job: dict, spec, recipe: tuple, session: _Session, pack: int):
    """(the job's candidate compiled, loaded and checked on the sample shape, whether it was
    kept from before: ``_BUILDS``); or the error result of a wrong one (not kept)."""
    key = build_key(job)
    if key in _BUILDS:
        _BUILDS.move_to_end(key)
        return _BUILDS[key], True
    if job.get("library"):  # compiled by another worker (``compile_only``): loaded, then checked here
        module = session.load_library(job["library"])
    else:
        module = session.load(_compiled(job, spec))

    # Correctness first: on the sample shape, against the independent reference.
    check_key = tuple(sorted(job["check_shape"].items()))
    inputs = _kernel_inputs(recipe, check_key, pack)
    expected = _expected(recipe, check_key)
    output = session.tensor(np.full(expected.shape, np.nan, "float32"))
    module["main"](*spec.call_arguments(dict(check_key), [session.tensor(x) for x in inputs], output))
    got = output.numpy()
    if not np.allclose(got, expected, rtol=CHECK_RTOL, atol=CHECK_ATOL):
        worst = float(np.nanmax(np.abs(got - expected))) if np.isfinite(got).any() else float("nan")
        return {"error": f"wrong result on {dict(check_key)}: max abs error {worst:.3g}"}
    _BUILDS[key] = module
    while len(_BUILDS) > job.get("builds_kept", BUILDS_KEPT):
        _BUILDS.popitem(last=False)
    return module, False


class JobOperator:
    """A job's operator in this worker: its spec, the session its kernels run in, and the input
    whose copies stream from DRAM when ``stream`` (the weight of a dense layer, as the served
    model reads it: ``streaming.py``; only local CPU runs, where over RPC each call would be a
    round trip). What measuring and racing jobs share."""

    def __init__(self, job: dict, stream: bool):
        from dietserve.kernels.host import target_cores

        from ..ops import weight_input

        self.recipe = _freeze(job["recipe"])
        self.spec = _spec(self.recipe)
        kind = job["target"]["kind"]
        self.session = _session(job["device"], kind, target_cores(job["target"]))
        # Kernels on this machine's CPUs: the only ones whose weight can stream from DRAM here
        # (over RPC each call would be a round trip) and that other work here slows.
        self.on_this_cpu = self.session.remote is None and kind == "llvm"
        self.weight_index = weight_input(self.spec) if stream and self.on_this_cpu else None

    def other_load(self) -> OtherLoad | None:
        """What other work takes of this machine's CPUs from now (``host_load``), where the
        kernels run on them; else None."""
        return OtherLoad() if self.on_this_cpu else None

    def built_and_checked(self, job: dict, pack: int):
        """``job``'s candidate (of this operator) built, loaded and checked: ``_built_and_checked``."""
        return _built_and_checked(job, self.spec, self.recipe, self.session, pack)

    def call_arguments(self, shape: dict, pack: int) -> list[list]:
        """The arguments of a call on ``shape``, inputs laid out for a kernel packed in ``pack``-wide
        panels: one set, or where the weight streams, one set per copy of it (``_weight_copies``),
        the other inputs and the output shared."""
        arrays = _kernel_inputs(self.recipe, tuple(sorted(shape.items())), pack)
        output = self.session.tensor(np.empty(self.spec.output_shape(shape), "float32"))
        inputs = [self.session.tensor(x) for x in arrays]
        if self.weight_index is None:
            return [self.spec.call_arguments(shape, inputs, output)]
        weights = _weight_copies(self.session, self.recipe, pack, arrays[self.weight_index])
        return [self.spec.call_arguments(shape, [w if i == self.weight_index else x for i, x in enumerate(inputs)],
                                         output) for w in weights]


def _measure(job: dict, started: float) -> dict:
    from dietserve.kernels.microkernel import MicroKernel

    operator = JobOperator(job, stream=bool(job.get("stream_weights")))
    session = operator.session
    pack = 0 if job["kernel"] is None else MicroKernel.from_json(job["kernel"]).pack
    outcome = operator.built_and_checked(job, pack)
    if isinstance(outcome, dict):  # a wrong result
        return {**outcome, "seconds": time.perf_counter() - started}
    module, reused = outcome
    built = time.perf_counter()
    if job.get("build_only"):  # built ahead (``LocalRunner.prepare``): timed by a later job
        return {"error": None, "build_seconds": built - started, "build_reused": reused, "seconds": built - started}
    function = module["main"]

    latencies, references = {}, {}
    timer = module.time_evaluator("main", session.device, number=job.get("number", 3), repeat=job.get("repeat", 5),
                                  min_repeat_ms=job.get("min_repeat_ms", 0))
    reference = reference_kernel(operator, job)
    load = operator.other_load()
    for shape in job["shapes"]:
        key = tuple(sorted(shape.items()))
        sets = operator.call_arguments(shape, pack)
        if operator.weight_index is not None:  # cycle through the weight's copies
            latencies[_shape_text(key)] = time_streaming(function, sets, job.get("repeat", 5),
                                                         job.get("min_repeat_ms", 0) / 1e3)
            continue
        (args,) = sets
        function(*args)  # warm-up: caches, page faults, thread pool
        if session.remote is None:
            # One warm call decides whether the candidate is worth repeats (the first call pays
            # for page faults and waking the pool: at small shapes several times the kernel).
            probe = time.perf_counter()
            function(*args)
            if time.perf_counter() - probe > job.get("abandon_above_s", float("inf")):
                latencies[_shape_text(key)] = time.perf_counter() - probe  # hopeless: not worth repeats
                continue
        if reference is not None:
            beside = time_beside_reference(operator, function, args, reference, shape, job)
            latencies[_shape_text(key)] = beside.candidate_s
            references[_shape_text(key)] = {"seconds": beside.reference_s, "ratio": beside.ratio}
            continue
        latencies[_shape_text(key)] = float(np.median(timer(*args).results))
    return {"latencies": latencies, "references": references, "error": None, "build_seconds": built - started,
            "build_reused": reused, "others_share": None if load is None else load.share(),
            "seconds": time.perf_counter() - started}


def _weight_copies(session: _Session, recipe: tuple, pack: int, weight: np.ndarray) -> list:
    """Device copies of ``weight`` spanning twice the last-level cache, kept for the worker's
    life per (operator, packing): the weight does not depend on the shape."""
    key = (recipe, pack)
    if key not in session.kept:
        session.kept.clear()  # one operator's copies at a time (a 3072 x 768 weight: 7 x 9.4 MB)
        count = copies(weight.nbytes, last_level_cache_bytes())
        # on huge pages, where the served model keeps its weights (only local CPU jobs stream)
        session.kept[key] = on_huge_pages([weight] * count)
    return session.kept[key]


def resolve(path: str):
    """``"package.module:function"`` -> the function that applies a micro-kernel (custom schedules)."""
    import importlib

    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"schedule function must look like 'package.module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


def _shape_text(key: tuple) -> str:
    return ",".join(f"{name}={value}" for name, value in key)


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
    """The worker loop over stdin/stdout frames: one job in, one result out, until EOF.

    The protocol owns the original stdout; anything else printing (TVM, nvcc) goes to stderr.
    """
    # Run as ``-m``, this file is ``__main__``; the races' module imports it as ``worker``. The jobs
    # go through that one copy, so measuring and racing share its kept builds and sessions.
    from . import racing, worker

    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    protocol_in = os.fdopen(0, "rb")
    while True:
        job = _read_frame(protocol_in)
        if job is None:
            return
        if job.get("compile_to"):
            result = worker.compile_only(job)
        else:
            result = racing.race(job) if job.get("race") else worker.measure(job)
        write_frame(protocol_out, result)


if __name__ == "__main__":
    main()
