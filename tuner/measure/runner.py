"""Measurement jobs in worker processes, a timeout each, on this machine (``LocalRunner``) or a
device behind a TVM RPC tracker (``RPCRunner``): a candidate that crashes or hangs costs only itself.
``prepare`` builds ahead on one worker per core (building is most of a CPU trial). Only the first
worker times: the others compile libraries it loads, never running a kernel whose thread pool would
spin on the cores while it times."""

from __future__ import annotations

import contextlib
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
    workers: int | None = None  # None: one per core, at most MAX_WORKERS (each imports TVM, ~0.3 GB)
    builds_kept: int = BUILDS_KEPT  # as many as a tune builds: its later phases find them built

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.builds_kept < 1:
            raise ValueError(f"builds_kept must be at least 1, got {self.builds_kept}")

    def for_trials(self, trials: int) -> MeasureOptions:
        """Keeping every build of a ``trials``-trial tune of one operator (and its default kernel's)."""
        return replace(self, builds_kept=max(self.builds_kept, trials + 1))


class _Worker:
    """One ``python -m tuner.measure.worker`` process, spoken to in pickled frames over pipes: a plain
    subprocess, not multiprocessing, so the caller's main module is never re-imported."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.jobs_done = 0

    def ensure_started(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        # One BLAS thread for numpy's references: OpenBLAS's idle threads spin, slowing the timings.
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
            header = self._read_exactly(8, time.monotonic() + budget)
            result = pickle.loads(self._read_exactly(int.from_bytes(header, "little"), None))
        except TimeoutError:
            self.stop()
            return MeasureResult.failed(f"timeout: no result within {timeout_s:.0f} s (worker killed)")
        except (OSError, EOFError, pickle.UnpicklingError):
            exit_text = _describe_exit(self.stop(grace_s=5))
            return MeasureResult.failed(f"worker process died ({exit_text}) while measuring this candidate")
        self.jobs_done += 1
        return result

    def _read_exactly(self, size: int, deadline: float | None) -> bytes:
        """``size`` bytes from the worker; TimeoutError once past ``deadline`` (None: wait), EOFError if it died."""
        stream, data = self.process.stdout.fileno(), bytearray()
        while len(data) < size:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([stream], [], [], remaining)[0]:
                    raise TimeoutError
            chunk = os.read(stream, size - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)

    def stop(self, grace_s: float = 0.0) -> int | None:
        """Its exit status if it exits within ``grace_s``; else it and all it started are killed (None)."""
        process, self.process = self.process, None
        if process is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return process.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)
        return None

    def close_input(self) -> None:
        """EOF to the worker: it exits after its current job."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def candidates_folder(temp_root: str | None = None) -> tempfile.TemporaryDirectory:
    """A temporary folder for the builders' libraries, named after this process, after removing those
    of processes no longer running: a tuner killed outright cannot remove its own."""
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
        pass
    return True


class LocalRunner(contextlib.AbstractContextManager):
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
        self._timed: OrderedDict[str, None] = OrderedDict()  # the timing worker's builds, least recent first
        self._names = itertools.count()

    def describe(self) -> str:
        return "local"

    def _work(self, job: MeasureJob) -> WorkerJob:
        return WorkerJob(job, device=self.device, timing=self.options.timing, builds_kept=self.options.builds_kept)

    def prepare(self, jobs: Sequence[MeasureJob]) -> None:
        """Build ``jobs`` ahead on every worker at once: the timing worker in memory, the others into
        libraries; a failed build comes back as that job's result."""
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
                key, work = pending.popleft()  # atomic: the threads share the queue
            except IndexError:
                return
            if index == 0:
                result = self._workers[0].run(replace(work, build_only=True), self.options.timeout_s)
                self._after_timing_worker(key, result)
            else:  # a fresh name each: loading a path already loaded would return the old library
                library = os.path.join(self._libraries.name, f"candidate-{next(self._names)}.so")
                result = self._workers[index].run(replace(work, compile_to=library), self.options.timeout_s)
                if result.ok:
                    self._compiled[key] = library
            self._ahead[key] = result

    def run(self, job: MeasureJob) -> MeasureResult:
        work = self._work(job)
        key = build_key(work)
        ahead = self._ahead.pop(key, None)
        if ahead is not None and not ahead.ok:
            return ahead  # the build failed: as its timing job would have
        result = self._workers[0].run(replace(work, library=self._compiled.get(key)), self.options.timeout_s)
        if ahead is not None and result.ok:  # the cost of building ahead: loading a library is not a build
            result = replace(result, build_seconds=ahead.build_seconds, build_reused=False, built_ahead=True)
        self._after_timing_worker(key, result)
        return result

    def _after_timing_worker(self, key: str, result: MeasureResult) -> None:
        """Track the timing worker's cache: a worker that died took its builds (not the libraries)."""
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
        for each in self._workers:  # all told first: each takes a while to exit
            each.close_input()
        for each in self._workers:
            each.stop(grace_s=5)
        if self._libraries is not None:
            self._libraries.cleanup()

    def __exit__(self, *_exc) -> None:
        self.close()


class RPCRunner(LocalRunner):
    """Measure on a device registered with a TVM RPC tracker under ``key``
    (``python -m tvm.exec.rpc_tracker`` + ``python -m tvm.exec.rpc_server --tracker ...``)."""

    def __init__(self, tracker: str, key: str, options: MeasureOptions = MeasureOptions(),
                 priority: int = 1, session_timeout_s: int = 120):
        # One worker: each holds its own RPC connection, and a second would wait for the device the first holds.
        super().__init__(replace(options, workers=1))
        host, _, port = tracker.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"tracker must be host:port, got {tracker!r}")
        self.device = {"kind": "rpc", "host": host, "port": int(port), "key": key, "priority": priority,
                       "session_timeout": session_timeout_s}
        self.features = RunnerFeatures()

    def describe(self) -> str:
        return f"rpc {self.device['host']}:{self.device['port']} key={self.device['key']}"
