"""Run measurement jobs in a separate worker process with a timeout per job.

A candidate that crashes the worker (a segfault in generated code, an abort in the compiler)
or hangs past the timeout costs only that candidate: the worker is killed if needed and a
fresh one starts for the next job. Two device kinds: this machine (``LocalRunner``) or a
remote device reached through a TVM RPC tracker (``RPCRunner``); both build in the worker.

Building is most of a CPU trial (TVM's lowering of a kernel: 0.2-0.7 s, timing it 0.1-0.2 s), so
a local runner keeps one worker per core (``MeasureOptions.workers``) and ``prepare`` builds the
candidates the tuner is about to measure on all of them at once, as MetaSchedule's builder does.
Every timing runs in the first worker, after the builds, one at a time. The others only compile
(into shared libraries the first loads and checks): a worker that has run a parallel kernel
keeps its TVM thread pool spinning on the cores for a while, and when two workers took turns at
timing, the same kernels timed 1.15x slower in the median and up to 3.2x (attention scores,
2-core znver4).
"""

from __future__ import annotations

import itertools
import os
import pickle
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from . import racing, worker

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # so ``-m tuner.measure.worker`` imports this tree
STARTUP_GRACE_S = 30.0  # a fresh worker imports TVM before its first job
CANDIDATES_PREFIX = "dietserve-candidates-"  # + the owning process's pid + "-": see ``candidates_folder``


@dataclass(frozen=True)
class MeasureOptions:
    number: int = 3  # runs per timed repeat
    repeat: int = 5  # timed repeats; the median is kept
    # A repeat lasts at least this long (more runs of a short kernel): a 30 us kernel timed over
    # 2 runs reads its thread pool's wake-up, not its own speed (T = 1 dense: 50 us, not 30).
    min_repeat_ms: int = 10
    timeout_s: float = 60.0  # per job: build + check + timing of every shape
    # CPU dense layers: time each call on a weight fresh from DRAM, as the served model reads
    # it (``streaming.py``). Off by default: plans tuned so ran no faster in the model than
    # plans tuned on a cached weight (tests/benchmarks/HISTORY.md). Local only.
    stream_weights: bool = False
    # Worker processes (builds in parallel, ``LocalRunner.prepare``); None: one per core, at most
    # ``MAX_WORKERS``. Each imports TVM (about 0.3 GB).
    workers: int | None = None
    # Candidates the timing worker keeps built (``worker.BUILDS_KEPT``): as many as a tune builds
    # (``for_trials``), so the races at its end find their finalists still built.
    builds_kept: int = worker.BUILDS_KEPT

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.builds_kept < 1:
            raise ValueError(f"builds_kept must be at least 1, got {self.builds_kept}")

    def for_trials(self, trials: int) -> MeasureOptions:
        """These options, keeping every build of a ``trials``-trial tune of one operator (and its
        default kernel's): at least ``worker.BUILDS_KEPT``."""
        return replace(self, builds_kept=max(self.builds_kept, trials + 1))


MAX_WORKERS = 4


class _Worker:
    """One ``python -m tuner.measure.worker`` process, spoken to in pickled frames over pipes.

    A plain subprocess (not multiprocessing) so the caller's main module is never re-imported.
    """

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.jobs_done = 0

    def ensure_started(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        # numpy's references run on one BLAS thread: OpenBLAS's workers spin on the cores for
        # ~0.1 s after a call, and a kernel timed meanwhile waits a scheduler tick per parallel call.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tuner.measure.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            cwd=_PACKAGE_ROOT, start_new_session=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
        )
        self.jobs_done = 0

    def run(self, job: dict, timeout_s: float) -> dict:
        self.ensure_started()
        budget = timeout_s + (STARTUP_GRACE_S if self.jobs_done == 0 else 0.0)
        try:
            worker.write_frame(self.process.stdin, job)
            result = self._read(budget)
        except (BrokenPipeError, ConnectionResetError, OSError, EOFError, pickle.UnpicklingError):
            result = "died"
        if result == "timeout":
            self.kill()
            return {"error": f"timeout: no result within {timeout_s:.0f} s (worker killed)"}
        if result == "died":
            code = self._reap()
            return {"error": f"worker process died ({_describe_exit(code)}) while measuring this candidate"}
        self.jobs_done += 1
        return result

    def _read(self, budget: float):
        stream = self.process.stdout
        deadline = time.monotonic() + budget
        header = b""
        while len(header) < 8:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            ready, _, _ = select.select([stream], [], [], remaining)
            if not ready:
                return "timeout"
            chunk = os.read(stream.fileno(), 8 - len(header))
            if not chunk:
                return "died"
            header += chunk
        size = int.from_bytes(header, "little")
        payload = bytearray()
        while len(payload) < size:
            chunk = os.read(stream.fileno(), size - len(payload))
            if not chunk:
                return "died"
            payload += chunk
        return pickle.loads(bytes(payload))

    def _reap(self) -> int | None:
        if self.process is None:
            return None
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        self.process = None
        return code

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # the worker and anything it started
            except ProcessLookupError:
                pass
            self.process.wait(timeout=5)
        self.process = None

    def close_input(self) -> None:
        """EOF to the worker: it exits after its current job."""
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.close_input()
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def candidates_folder(temp_root: str | None = None) -> tempfile.TemporaryDirectory:
    """A temporary folder for the builders' libraries, named after this process, after removing
    those of processes that no longer run: a tuner killed outright (the server's re-tuning job
    past its budget, or killed by hand) cannot remove its own, and each held a few MB."""
    root = temp_root or tempfile.gettempdir()
    pattern = re.compile(re.escape(CANDIDATES_PREFIX) + r"(\d+)-")
    for entry in os.scandir(root):
        owner = pattern.match(entry.name)
        if owner and entry.is_dir(follow_symlinks=False) and not _running(int(owner.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"{CANDIDATES_PREFIX}{os.getpid()}-", dir=root)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: running
        return True
    return True


class LocalRunner:
    """Measure on this machine's CPU (llvm) or first GPU (cuda)."""

    device = {"kind": "local"}

    def __init__(self, options: MeasureOptions = MeasureOptions()):
        self.options = options
        count = options.workers or min(os.cpu_count() or 1, MAX_WORKERS)
        self._workers = [_Worker() for _ in range(count)]  # [0] times; the others only compile
        self._libraries = candidates_folder() if count > 1 else None
        self._compiled: dict[str, str] = {}  # build key -> a library a builder compiled it into
        self._ahead: dict[str, dict] = {}  # build key -> its prepare result, until it is timed
        # The build keys the timing worker holds, least recently used first: what its cache keeps
        # (``MeasureOptions.builds_kept``), so an evicted build is built ahead again.
        self._timed: OrderedDict[str, None] = OrderedDict()
        self._names = itertools.count()

    @property
    def streams_weights(self) -> bool:
        """Whether dense layers are timed on weights fresh from DRAM (records say so)."""
        return self.options.stream_weights and self.device["kind"] == "local"

    def describe(self) -> str:
        return "local, weights from DRAM" if self.streams_weights else "local"

    def _job(self, job: dict) -> dict:
        return {**job, "device": self.device, "number": self.options.number, "repeat": self.options.repeat,
                "min_repeat_ms": self.options.min_repeat_ms, "stream_weights": self.options.stream_weights,
                "builds_kept": self.options.builds_kept}

    def prepare(self, jobs: list[dict]) -> None:
        """Build the candidates of ``jobs`` ahead, on every worker at once: the timing worker
        builds (and checks) its share in memory, the others compile theirs into libraries it
        loads when ``run`` times them; a build that fails comes back as that job's result."""
        pending = deque()
        for job in map(self._job, jobs):
            key = worker.build_key(job)
            known = key in self._compiled or key in self._ahead or key in self._timed
            if not known and all(key != queued for queued, _ in pending):
                pending.append((key, job))
        if len(self._workers) < 2 or len(pending) < 2:
            return  # nothing to overlap: built when timed

        def drain(index: int) -> None:
            while True:
                try:
                    key, job = pending.popleft()  # (atomic: the threads share the queue)
                except IndexError:
                    return
                if index == 0:
                    result = self._workers[0].run({**job, "build_only": True}, self.options.timeout_s)
                    if self._workers[0].process is None:  # died or killed: its builds went with it
                        self._timed.clear()
                    elif result.get("error") is None:
                        self._held(key)
                else:
                    # (a fresh name each: loading a path already loaded would return the old library)
                    library = os.path.join(self._libraries.name, f"candidate-{next(self._names)}.so")
                    result = self._workers[index].run({**job, "compile_to": library}, self.options.timeout_s)
                    if result.get("error") is None:
                        self._compiled[key] = library
                self._ahead[key] = result

        with ThreadPoolExecutor(len(self._workers)) as pool:
            list(pool.map(drain, range(len(self._workers))))

    def run(self, job: dict) -> dict:
        job = self._job(job)
        key = worker.build_key(job)
        ahead = self._ahead.pop(key, None)
        if ahead is not None and ahead.get("error") is not None:
            return ahead  # the build failed: as its timing job would have
        timer = self._workers[0]
        result = timer.run({**job, "library": self._compiled.get(key)}, self.options.timeout_s)
        if ahead is not None and result.get("error") is None:
            # (the record shows what building it cost, ahead: loading a library is not a build)
            result = {**result, "build_seconds": ahead["build_seconds"], "build_reused": False, "built_ahead": True}
        if timer.process is None:  # it died or was killed: its builds went with it (not the libraries)
            self._timed.clear()
        elif result.get("error") is None:
            self._held(key)
        return result

    def race(self, job: dict) -> dict:
        """Time the kernels of a race ``job`` (``racing.race``) in the timing worker, in turn, on
        one shape; each one's build from the search is reused where it is still held (in the
        worker, or a builder's library). A timeout or a crash fails the whole race (``error``)."""
        job = self._job({**job, "race": True})
        keys = [worker.build_key(racing.race_entrant(job, kernel)) for kernel in job["kernels"]]
        for key in keys:  # (built ahead or not, each is built or loaded now)
            self._ahead.pop(key, None)
        timer = self._workers[0]
        # (each kernel may be built again: the budget of a job per kernel)
        result = timer.run({**job, "libraries": [self._compiled.get(key) for key in keys]},
                           self.options.timeout_s * max(1, len(keys)))
        if timer.process is None:
            self._timed.clear()
        elif result.get("error") is None:
            for key, error in zip(keys, result["errors"], strict=True):
                if error is None:
                    self._held(key)
        return result

    def _held(self, key: str) -> None:
        """The timing worker built or used ``key``: as its cache does, keep it, most recent last."""
        self._timed[key] = None
        self._timed.move_to_end(key)
        while len(self._timed) > self.options.builds_kept:
            self._timed.popitem(last=False)

    def close(self) -> None:
        for each in self._workers:  # (all told to finish first: each takes a while to exit)
            each.close_input()
        for each in self._workers:
            each.close()
        if self._libraries is not None:
            self._libraries.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


class RPCRunner(LocalRunner):
    """Measure on a device registered with a TVM RPC tracker under ``key``
    (``python -m tvm.exec.rpc_tracker`` + ``python -m tvm.exec.rpc_server --tracker ...``)."""

    def __init__(self, tracker: str, key: str, options: MeasureOptions = MeasureOptions(),
                 priority: int = 1, session_timeout_s: int = 120):
        # One worker: each holds its own session, and a second would wait on the tracker for a
        # device the first holds.
        super().__init__(replace(options, workers=1))
        host, _, port = tracker.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"tracker must be host:port, got {tracker!r}")
        self.device = {"kind": "rpc", "host": host, "port": int(port), "key": key, "priority": priority,
                       "session_timeout": session_timeout_s}

    def describe(self) -> str:
        return f"rpc {self.device['host']}:{self.device['port']} key={self.device['key']}"
