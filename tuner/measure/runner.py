"""Run measurement jobs in a separate worker process with a timeout per job.

A candidate that crashes the worker (a segfault in generated code, an abort in the compiler)
or hangs past the timeout costs only that candidate: the worker is killed if needed and a
fresh one starts for the next job. Two device kinds: this machine (``LocalRunner``) or a
remote device reached through a TVM RPC tracker (``RPCRunner``); both build in the worker.

Building is most of a CPU trial, so a local runner keeps one worker per core and ``prepare``
builds the candidates the tuner is about to measure on all of them at once, as MetaSchedule's
builder does. Every timing runs in the first worker, one at a time; the others only compile
into shared libraries the first loads and checks (a worker that has run a parallel kernel keeps
its TVM thread pool spinning on the cores for a while, which slows another's timings).
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import worker
from .job import MeasureJob, MeasureResult, RunnerFeatures, WorkerJob, build_key
from .timing import TimingPolicy

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # so ``-m tuner.measure.worker`` imports this tree
STARTUP_GRACE_S = 30.0  # a fresh worker imports TVM before its first job
CANDIDATES_PREFIX = "dietserve-candidates-"  # + the owning process's pid + "-": see ``candidates_folder``
BUILDS_KEPT = 64  # builds the timing worker keeps, at least (``MeasureOptions.for_trials``)
MAX_WORKERS = 4


@dataclass(frozen=True)
class MeasureOptions:
    timing: TimingPolicy = field(default_factory=TimingPolicy)
    timeout_s: float = 60.0  # per job: build + check + timing of every shape
    # Worker processes (builds in parallel, ``LocalRunner.prepare``); None: one per core, at most
    # ``MAX_WORKERS``. Each imports TVM (about 0.3 GB).
    workers: int | None = None
    builds_kept: int = BUILDS_KEPT  # as many as a tune builds: its later phases find them built

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.builds_kept < 1:
            raise ValueError(f"builds_kept must be at least 1, got {self.builds_kept}")

    def for_trials(self, trials: int) -> MeasureOptions:
        """These options, keeping every build of a ``trials``-trial tune of one operator (and its
        default kernel's)."""
        return replace(self, builds_kept=max(self.builds_kept, trials + 1))


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

    def run(self, work: WorkerJob, timeout_s: float) -> MeasureResult:
        self.ensure_started()
        budget = timeout_s + (STARTUP_GRACE_S if self.jobs_done == 0 else 0.0)
        try:
            worker.write_frame(self.process.stdin, work)
            result = self._read(budget)
        except (BrokenPipeError, ConnectionResetError, OSError, EOFError, pickle.UnpicklingError):
            result = "died"
        if result == "timeout":
            self.kill()
            return MeasureResult.failed(f"timeout: no result within {timeout_s:.0f} s (worker killed)")
        if result == "died":
            code = self._reap()
            return MeasureResult.failed(f"worker process died ({_describe_exit(code)}) while measuring this candidate")
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

    def __init__(self, options: MeasureOptions = MeasureOptions()):
        self.options = options
        self.device: dict = {"kind": "local"}
        count = options.workers or min(os.cpu_count() or 1, MAX_WORKERS)
        self.features = RunnerFeatures(builds_ahead=count > 1, local=True)
        self._workers = [_Worker() for _ in range(count)]  # [0] times; the others only compile
        self._libraries = candidates_folder() if count > 1 else None
        self._compiled: dict[str, str] = {}  # build key -> a library a builder compiled it into
        self._ahead: dict[str, MeasureResult] = {}  # build key -> its prepare result, until it is timed
        # The build keys the timing worker holds, least recently used first: what its cache keeps,
        # so an evicted build is built ahead again.
        self._timed: OrderedDict[str, None] = OrderedDict()
        self._names = itertools.count()

    def describe(self) -> str:
        return "local"

    def _work(self, job: MeasureJob) -> WorkerJob:
        return WorkerJob(job, device=self.device, timing=self.options.timing, builds_kept=self.options.builds_kept)

    def prepare(self, jobs: Sequence[MeasureJob]) -> None:
        """Build the candidates of ``jobs`` ahead, on every worker at once: the timing worker
        builds (and checks) its share in memory, the others compile theirs into libraries it
        loads when ``run`` times them; a build that fails comes back as that job's result."""
        pending: deque = deque()
        for work in map(self._work, jobs):
            key = build_key(work)
            known = key in self._compiled or key in self._ahead or key in self._timed
            if not known and all(key != queued for queued, _ in pending):
                pending.append((key, work))
        if len(self._workers) < 2 or len(pending) < 2:
            return  # nothing to overlap: built when timed
        with ThreadPoolExecutor(len(self._workers)) as pool:
            list(pool.map(lambda index: self._drain(index, pending), range(len(self._workers))))

    def _drain(self, index: int, pending: deque) -> None:
        while True:
            try:
                key, work = pending.popleft()  # (atomic: the threads share the queue)
            except IndexError:
                return
            if index == 0:
                result = self._workers[0].run(work.with_(build_only=True), self.options.timeout_s)
                self._after_timing_worker(key, result)
            else:
                # (a fresh name each: loading a path already loaded would return the old library)
                library = os.path.join(self._libraries.name, f"candidate-{next(self._names)}.so")
                result = self._workers[index].run(work.with_(compile_to=library), self.options.timeout_s)
                if result.ok:
                    self._compiled[key] = library
            self._ahead[key] = result

    def run(self, job: MeasureJob) -> MeasureResult:
        work = self._work(job)
        key = build_key(work)
        ahead = self._ahead.pop(key, None)
        if ahead is not None and not ahead.ok:
            return ahead  # the build failed: as its timing job would have
        result = self._workers[0].run(work.with_(library=self._compiled.get(key)), self.options.timeout_s)
        if ahead is not None and result.ok:
            # (the record shows what building it cost, ahead: loading a library is not a build)
            result = replace(result, build_seconds=ahead.build_seconds, build_reused=False, built_ahead=True)
        self._after_timing_worker(key, result)
        return result

    def _after_timing_worker(self, key: str, result: MeasureResult) -> None:
        """Keep count of the builds the timing worker holds, as its cache does (most recent last);
        a worker that died or was killed took its builds with it (not the libraries)."""
        if self._workers[0].process is None:
            self._timed.clear()
        elif result.ok:
            self._held(key)

    def _held(self, key: str) -> None:
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
        self.features = RunnerFeatures()

    def describe(self) -> str:
        return f"rpc {self.device['host']}:{self.device['port']} key={self.device['key']}"
