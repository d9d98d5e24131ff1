"""When to re-tune: the server compares the traffic it records with the mix the served version's
kernels were tuned for, and when they have drifted apart, runs the re-tuning job
(``python -m dietserve retune``) as a separate, lower-priority OS process. The job tunes for the
recorded traffic and publishes a new version to the store; the hot swap (``swap.py``) checks it
and swaps it in. The server never imports the tuner: the job runs it as its own process.

Drift is the total variation distance between the two sequence-length mixes over the batcher's
length buckets: the share of traffic that would have to move to another bucket to match the mix
the kernels were tuned for (a version without a recorded mix was tuned for every length equally).
A run starts when drift >= ``drift_threshold``, at least ``min_rows`` rows have been recorded,
no run is going, no published version is waiting for its swap, and ``min_interval_seconds``
have passed since the last one started.

A run that changed nothing served (it found no faster plans, or the hot swap refused what it
published) leaves the traffic as far from the served version as before; a second run on the
same mix would reuse the first one's records and find the same plans, while the server's
requests pay for its tuning (p99 about 2x idle on 2 cores, ``bench_retune.py``). So the next
run also waits until the traffic has drifted by ``drift_threshold`` from the mix that run
tuned for. A run that failed (a crash, a kill past its budget) is retried after the interval.

A server serving several version stores has a policy for each, and one job runs at a time
(``JobSlot``): a job uses every core it may, so two at once would each take twice as long while
the requests pay for both. A policy whose job would start waits, and starts it once the slot is
free. Servers sharing a store (replicas on a shared volume) take turns the same way through the
store's lock: one job tunes for them all, and each server's hot swap checks what it publishes.
A job waiting to tune the host at start (``start_reason``) is dropped once the served version
is a tuned one: another server's job got there first. A host tune that changes nothing served
marks the served version as kept (``VersionStore.keep_as_tuned``): a restart then serves it
without tuning again, as it would a tuned version.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.traffic import Traffic, TrafficError, mix_distance
from ..runtime.versions import RETUNE_LOCK
from .metrics import ModelMetrics
from .swap import HotSwap
from .traffic_log import TrafficLog

log = logging.getLogger("dietserve.server")

RETUNE_DIR = "retune"  # in the store: traffic snapshots and the jobs' logs
EXIT_NOT_FASTER = 3  # the job's exit code when it tuned but predicts no gain, so published nothing
OUTCOMES = {0: "published", EXIT_NOT_FASTER: "not-faster"}  # any other exit code: "failed"


@dataclass
class RetuneSettings:
    command: Callable[[Path, Path], list[str]]  # (store, traffic snapshot) -> argv of the job
    drift_threshold: float = 0.3
    min_rows: int = 200
    min_interval_seconds: float = 3600.0
    check_seconds: float = 30.0
    time_budget_seconds: float = 3600.0  # the job is killed after this (plus a minute to compile)
    cpus: frozenset[int] = field(default_factory=frozenset)  # empty: every CPU
    nice: int = 10
    # Given, the job starts at the first check, whatever the traffic (``serve --auto-tune``: the
    # served version was not tuned for this host), saying this as its reason.
    start_reason: str | None = None
    progress_seconds: float = 60.0  # how often a running job's progress is said
    # A lock file on this machine through which the server's batches and the job's timings take
    # turns on the CPUs (``host/cpu_turns.py``); None: the job measures elsewhere (RPC).
    cpu_turns: Path | None = None
    # The job's environment (None: this process's): it builds kernels, which this process,
    # serving on TVM's runtime alone, cannot.
    environment: Mapping[str, str] | None = None


_OPERATOR_LINE = re.compile(rb"\[(\d+)/(\d+)\] ")
_TUNED_LINE = re.compile(rb"tuned \d+ operators in ")  # the tuner's last line


def job_progress(log_path: Path | None) -> tuple[int, int]:
    """(operators done, operators) from a job's log: the tuner starts each with ``[k/n]``; (0, 0)
    before the first."""
    try:
        with open(log_path, "rb") as stream:
            stream.seek(max(0, stream.seek(0, os.SEEK_END) - (64 << 10)))  # the tail: logs grow
            tail = stream.read()
    except (OSError, TypeError):
        return 0, 0
    found = _OPERATOR_LINE.findall(tail)
    if not found:
        return 0, 0
    current, total = (int(x) for x in found[-1])
    finished = _TUNED_LINE.search(tail[tail.rfind(b"[%d/%d] " % (current, total)):]) is not None
    return (total if finished else current - 1), total


class JobSlot:
    """The one re-tuning job a server runs at a time, across its models: who holds it."""

    def __init__(self) -> None:
        self.holder: RetunePolicy | None = None


class RetunePolicy:
    def __init__(self, settings: RetuneSettings, hot_swap: HotSwap, traffic: TrafficLog, edges: list[int],
                 max_seq_len: int, metrics: ModelMetrics, say: Callable[[str], None], slot: JobSlot | None = None):
        self.settings, self.hot_swap, self.traffic = settings, hot_swap, traffic
        self.edges, self.max_seq_len, self.metrics, self.say = edges, max_seq_len, metrics, say
        self.slot = slot or JobSlot()
        self._store_lock = hot_swap.store.lock(RETUNE_LOCK)  # other servers' jobs on this store
        self._waiting_said = False  # that a job waits for the slot, once per wait
        self.process: subprocess.Popen | None = None
        self._started = float("-inf")
        self._tuned_for: tuple[int, dict[int, float]] | None = None  # (version, its mix), read once
        # (served version, traffic mix) when the running (or last) job started: the mix is what its
        # snapshot holds
        self._job: tuple[int, dict[int, float]] | None = None
        self._job_tunes_host = False  # the job was started by ``start_reason``
        self._awaiting_swap = False  # the last job published; the hot swap has not decided yet
        # ``_job`` of the last job that changed nothing served; it holds while that version is
        # served (another version, a rollback's say, is worth a run on any mix)
        self._tried: tuple[int, dict[int, float]] | None = None
        self._held_back = False  # the hold has been logged (once per tried mix)
        self._start_reason = settings.start_reason
        self._progress_said = float("-inf")
        self._log_path: Path | None = None

    def tuned_for(self) -> dict[int, float]:
        version = self.hot_swap.version
        if self._tuned_for is None or self._tuned_for[0] != version:
            mix = {length: 1.0 for length in range(1, self.max_seq_len + 1)}
            path = self.hot_swap.store.tuned_for(version)
            if path is not None:
                try:
                    mix = Traffic.load(path).row_weights()
                except TrafficError as err:
                    log.error("%s; taking the version as tuned for every length equally", err)
            self._tuned_for = (version, mix)
        return self._tuned_for[1]

    def drift(self, observed: dict[int, float]) -> float:
        return mix_distance(observed, self.tuned_for(), self.edges)

    async def watch(self) -> None:
        while True:
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the policy must outlive any one failure
                log.exception("the re-tuning policy failed a check; serving goes on")
            await asyncio.sleep(self.settings.check_seconds)

    def step(self) -> None:
        now = time.monotonic()
        if self.process is not None:
            self._follow(now)
            return
        if self.hot_swap.store.newer_candidate(self.hot_swap.version) is not None:
            return  # a published version waits for its check and swap: measure drift against it then
        if self._awaiting_swap:
            self._awaiting_swap = False
            if self.hot_swap.version <= self._job[0]:  # (not a later version: refused)
                self._tried_without_change("its version was not swapped in")
        observed = self.traffic.traffic.row_weights()
        if self._start_reason is not None and self.hot_swap.store.tuned(self.hot_swap.version):
            self._start_reason = None
            self.say(f"not tuning at start: version {self.hot_swap.version} is tuned (another server's job)")
        if self._start_reason is not None:
            if self.start(self._start_reason, observed):
                self._start_reason, self._job_tunes_host = None, True
            return
        drift = self.drift(observed)
        self.metrics.traffic_drift.set(drift)
        rows = sum(observed.values())
        threshold = self.settings.drift_threshold
        # Weights are floats rescaled on each decay: allow for their rounding at the boundary.
        if (drift >= threshold and rows >= self.settings.min_rows * (1 - 1e-9)
                and now - self._started >= self.settings.min_interval_seconds):
            tried = self._tried[1] if self._tried is not None and self._tried[0] == self.hot_swap.version else None
            moved = None if tried is None else mix_distance(observed, tried, self.edges)
            if moved is None or moved >= threshold:
                if self.start(f"drift {drift:.2f} >= {threshold}", observed):
                    self._tried, self._job_tunes_host = None, False
            elif not self._held_back:
                self._held_back = True
                self.say(f"not re-tuning: drift {drift:.2f} from the served version, but {moved:.2f} (< {threshold})"
                         " from the traffic the last job tuned for without changing what is served")

    def _tried_without_change(self, why: str) -> None:
        self._tried, self._held_back = self._job, False
        if self._job_tunes_host:
            self.hot_swap.store.keep_as_tuned(self._job[0], f"a job tuning this host changed nothing served ({why})")
        self.say(f"the re-tuning job changed nothing served ({why}): the next one waits until the traffic "
                 f"drifts {self.settings.drift_threshold} from the mix it tuned for")

    def start(self, reason: str, observed: dict[int, float]) -> bool:
        """Runs the job on a snapshot of the traffic, whose mix is ``observed``, unless another
        model's job holds the slot or another server's the store (False: the next checks try
        again)."""
        busy = None
        if self.slot.holder is not None and self.slot.holder is not self:
            busy = "another model's job is running"
        elif not self._store_lock.acquire(wait=False):
            busy = f"another server's job on {self.hot_swap.store.root} is running"
        if busy is not None:
            if not self._waiting_said:
                self._waiting_said = True
                self.say(f"re-tuning ({reason}) waits: {busy}")
            return False
        self._waiting_said = False
        folder = self.hot_swap.store.root / RETUNE_DIR
        stamp = time.strftime("%Y%m%d-%H%M%S")
        snapshot, log_path = folder / f"traffic-{stamp}.json", folder / f"job-{stamp}.log"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.traffic.traffic.save(snapshot)
            with log_path.open("w") as job_log:
                self.process = subprocess.Popen(self.settings.command(self.hot_swap.store.root, snapshot),
                                                stdout=job_log, stderr=subprocess.STDOUT, start_new_session=True,
                                                env=self.settings.environment)
        except BaseException:
            self._store_lock.release()  # no job: the other servers may run theirs
            raise
        self._job, self._log_path = (self.hot_swap.version, observed), log_path
        self.slot.holder = self
        # Before the job has started any thread or process of its own (Python takes longer to start).
        os.setpriority(os.PRIO_PROCESS, self.process.pid, self.settings.nice)
        if self.settings.cpus:
            os.sched_setaffinity(self.process.pid, self.settings.cpus)
        self._started = time.monotonic()
        self.metrics.retune_running.set(1)
        cpus = ",".join(map(str, sorted(self.settings.cpus))) or "all"
        self.say(f"re-tuning ({reason}): pid {self.process.pid}, CPUs {cpus}, nice {self.settings.nice}, "
                 f"log {log_path}")
        return True

    def _follow(self, now: float) -> None:
        code = self.process.poll()
        elapsed = now - self._started
        if code is None:
            if elapsed > self.settings.time_budget_seconds + 60:
                self._kill()
                self.say(f"re-tuning job {self.process.pid} ran past its budget; killed")
            elif now - self._progress_said >= self.settings.progress_seconds:
                self._progress_said = now
                self._say_progress(elapsed)
            return
        outcome = OUTCOMES.get(code, "failed")
        self.metrics.retune_runs.labels(outcome).inc()
        self.metrics.retune_duration.set(elapsed)
        self.metrics.retune_running.set(0)
        self.metrics.retune_progress.set(0)
        self.say(f"re-tuning job {self.process.pid} {outcome} (exit {code}) after {elapsed:.0f} s")
        self.process = None
        self.slot.holder = None
        self._store_lock.release()
        if outcome == "not-faster":
            self._tried_without_change("no faster plans")
        elif outcome == "published":
            # decided in ``step`` once no candidate waits (the swap may already have taken it:
            # hence the comparison with the version served at the start)
            self._awaiting_swap = True

    def _say_progress(self, elapsed: float) -> None:
        """The stage the job's log shows (the tuner's ``[k/n] operator`` lines), and an estimate of
        the time left at the pace of the operators done."""
        done, total = job_progress(self._log_path)
        if total == 0:
            self.say(f"re-tuning: {elapsed:.0f} s in, compiling and extracting the operators")
            return
        self.metrics.retune_progress.set(done / total)
        if done == total:
            self.say(f"re-tuning: {elapsed:.0f} s in, every operator tuned; compiling the tuned artifact")
            return
        left = f", about {elapsed / done * (total - done):.0f} s left" if done else ""
        self.say(f"re-tuning: {elapsed:.0f} s in, operator {done + 1} of {total}{left}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self._kill()
        self._store_lock.release()

    def _kill(self) -> None:
        """The job and the worker processes it started: its own process group (``start``). Its
        builders' library folder stays behind, for the next tuner to remove
        (``tuner/measure/runner.candidates_folder``)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it exited meanwhile
            pass
