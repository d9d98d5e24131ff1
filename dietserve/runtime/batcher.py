"""Dynamic batching by sequence-length bucket, run off the event loop.

An idle engine runs a request at once. Requests that arrive while it is busy queue per bucket;
when the engine frees, the bucket whose head waited longest runs with its batch-mates, up to
``max_batch_size`` rows. Right after a batch of k requests the engine counts as busy a little
longer: it waits (at most until the head has queued ``max_queue_delay``) for k requests, because
clients whose answers just went out are about to send their next ones. One execution runs at a
time (the VM is not re-entrant, and on a CPU it already uses every core): a server with several
models gives their batchers one shared ``execution_lock``, which a batch takes once it is ready,
first come first served. Buckets grow
geometrically, so a batch's padding is under ``1 - 1/ratio`` of its tokens. With batching off
every request runs alone, in arrival order.

A packed engine (``Engine.packed``) runs any mix of lengths with no padded work, so it has no
buckets: one queue, first come first served, and a batch takes requests while their tokens stay
within ``max_batch_tokens`` (and their rows within ``max_batch_size``), as TEI's token budget
does. A request is never split: one over the budget runs alone.

A request whose caller has gone (cancelled) leaves the queue; one whose deadline passes while it
waits is answered with :class:`Expired` and not run. A failure while running a batch is given to
that batch's callers; a failure of the scheduler itself fails everything queued, refuses new
work and calls ``on_stopped``.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..host.cpu_turns import CpuTurns
from .engine import EncoderOutput, Engine
from .errors import Expired, NotReady, Overloaded
from .request import EncoderRequest

log = logging.getLogger("dietserve.batcher")


def bucket_edges(max_seq_len: int, ratio: float, granularity: int = 8) -> list[int]:
    """Upper edges: 8, 16, 24, 32, 40, 56, ... (each ~``ratio`` times the last, rounded up to
    ``granularity``), ending at ``max_seq_len``."""
    edges, edge = [], granularity
    while edge < max_seq_len:
        edges.append(edge)
        edge = max(edge + granularity, -(-int(edge * ratio) // granularity) * granularity)
    edges.append(max_seq_len)
    return edges


@dataclass(eq=False)
class Job:
    request: EncoderRequest
    bucket: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    tokens: int = 0  # the request's attended tokens (the token budget's unit)


@dataclass(frozen=True)
class BatchRun:
    """What one model execution did, for metrics and statistics."""

    rows: int
    seq_len: int
    real_tokens: int
    compute_seconds: float
    variants: tuple[tuple[str, str, int], ...]
    row_lengths: tuple[int, ...]  # unpadded tokens of each row
    packed: bool = False  # run by a packed engine: no padded work, each row at its own length


@dataclass(frozen=True)
class JobResult:
    output: EncoderOutput
    queue_seconds: float
    run: BatchRun


def pad_rows(jobs: list[Job], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack the jobs' rows, padding each to ``seq_len`` with masked-out token 0."""
    if len(jobs) == 1 and jobs[0].request.seq_len == seq_len:
        r = jobs[0].request
        return r.input_ids, r.attention_mask, r.token_type_ids
    rows = sum(job.request.rows for job in jobs)
    ids = np.zeros((rows, seq_len), np.int64)
    mask = np.zeros((rows, seq_len), np.int64)
    types = np.zeros((rows, seq_len), np.int64)
    start = 0
    for job in jobs:
        r = job.request
        stop = start + r.rows
        ids[start:stop, : r.seq_len] = r.input_ids
        mask[start:stop, : r.seq_len] = r.attention_mask
        types[start:stop, : r.seq_len] = r.token_type_ids
        start = stop
    return ids, mask, types


def largest_batch(engine: Engine, rows: int, tokens: int) -> tuple[int, int]:
    """The ``(rows, seq)`` of the largest batch the server forms from several requests, given its
    row limit and, for a packed engine, its token budget (``DynamicBatcher``): padded, ``rows``
    rows at the longest sequence; packed, the fewest rows of the longest sequence that hold the
    budget, and at least one such row (a longer request runs alone). A model of 8,192 positions
    warms up at one row where ``rows`` rows would take minutes and gigabytes."""
    seq, rows = engine.max_seq_len, min(rows, engine.max_batch)
    if engine.packed:
        rows = min(rows, max(1, -(-tokens // seq)))
    return rows, seq


class DynamicBatcher:
    def __init__(
        self,
        engine: Engine,
        *,
        batching: bool,
        max_batch_size: int,
        max_queue_delay_s: float,
        bucket_ratio: float,
        max_queue_rows: int,
        max_batch_tokens: int = 2048,
        on_queue_change: Callable[[int], None] | None = None,
        on_batch: Callable[[BatchRun], None] | None = None,
        on_stopped: Callable[[BaseException], None] | None = None,
        execution_lock: asyncio.Lock | None = None,
        cpu_turns: CpuTurns | None = None,
    ):
        self.engine = engine
        # Given, each execution takes a turn of the CPUs, shared with a tuning job's timings.
        self.cpu_turns = cpu_turns
        # Shared by every model of a server: asyncio's lock is fair (the longest waiter gets it
        # next), so batches of different models run in the order they became ready.
        self.execution_lock = execution_lock or asyncio.Lock()
        self.batching = batching
        self.max_batch_size = min(max_batch_size, engine.max_batch) if batching else 1
        self.max_queue_delay_s = max_queue_delay_s if batching else 0.0
        self.max_queue_rows = max_queue_rows
        self.max_batch_tokens = max_batch_tokens
        self.edges = bucket_edges(engine.max_seq_len, bucket_ratio) if batching else [engine.max_seq_len]
        self.withdrawn = 0  # requests whose caller went away while they were queued
        self.expired = 0  # requests whose deadline passed in the queue
        self.stopped: BaseException | None = None
        self._queues: dict[int, deque[Job]] = {}
        self._queued_rows = 0
        self._queued_jobs = 0
        self._last_batch_jobs = 0
        self._last_batch_end = float("-inf")
        self._on_queue_change = on_queue_change or (lambda rows: None)
        self._on_batch = on_batch or (lambda run: None)
        self._on_stopped = on_stopped or (lambda err: None)
        self._wakeup = asyncio.Event()
        self._closing = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dietserve-infer")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._schedule(), name="dietserve-batcher")

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def bucket_of(self, seq_len: int) -> int:
        if self.engine.packed:  # (read per request: a hot swap may change the layout)
            return self.edges[-1]
        return self.edges[bisect.bisect_left(self.edges, seq_len)]

    def _fits(self, rows: int, tokens: int) -> bool:
        """Whether a batch of ``rows`` rows and ``tokens`` attended tokens is within the limits."""
        return rows <= self.max_batch_size and (not self.engine.packed or tokens <= self.max_batch_tokens)

    async def submit(self, request: EncoderRequest) -> JobResult:
        if self.stopped is not None:
            raise NotReady(f"model execution has stopped ({self.stopped!r}); see the server log")
        if self._closing:
            raise NotReady("the server is shutting down")
        if self._queued_rows + request.rows > self.max_queue_rows:
            raise Overloaded(
                f"queue full: {self._queued_rows} rows are waiting (limit {self.max_queue_rows}); retry later"
            )
        job = Job(request, self.bucket_of(request.seq_len), asyncio.get_running_loop().create_future(),
                  tokens=request.tokens)
        self._queues.setdefault(job.bucket, deque()).append(job)
        self._count(job, +1)
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            self._withdraw(job)
            raise

    async def run_between_batches(self, function, *args):
        """Runs ``function(*args)`` on the execution thread between two batches (a hot swap's
        checks: one model run at a time, so no request waits behind more than one)."""
        async with self.execution_lock:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._in_turn, function, *args)

    def _in_turn(self, function, *args):
        if self.cpu_turns is None:
            return function(*args)
        with self.cpu_turns.turn():
            return function(*args)

    async def close(self) -> None:
        """Runs what is queued, then stops."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ queue bookkeeping

    def _count(self, job: Job, sign: int) -> None:
        self._queued_rows += sign * job.request.rows
        self._queued_jobs += sign
        self._on_queue_change(self._queued_rows)

    def _withdraw(self, job: Job) -> None:
        queue = self._queues.get(job.bucket)
        if queue is not None and job in queue:
            queue.remove(job)
            self._count(job, -1)
            self.withdrawn += 1

    def _oldest_bucket(self) -> int | None:
        heads = [(queue[0].enqueued, bucket) for bucket, queue in self._queues.items() if queue]
        return min(heads)[1] if heads else None

    def _full(self, bucket: int) -> bool:
        """Whether ``bucket``'s queue holds a whole batch already."""
        rows = sum(job.request.rows for job in self._queues[bucket])
        tokens = sum(job.tokens for job in self._queues[bucket])
        return not self._fits(rows + 1, tokens + 1)

    def _take(self, bucket: int) -> list[Job]:
        """Up to ``max_batch_size`` rows (and, packed, ``max_batch_tokens`` tokens) of ``bucket``
        in arrival order (always at least one job, even if it alone is larger), without the jobs
        whose deadline has passed."""
        queue, now = self._queues[bucket], time.monotonic()
        jobs, rows, tokens = [], 0, 0
        while queue and (not jobs or self._fits(rows + queue[0].request.rows, tokens + queue[0].tokens)):
            job = queue.popleft()
            self._count(job, -1)
            if job.request.deadline is not None and now > job.request.deadline:
                self.expired += 1
                if not job.future.done():
                    waited = (now - job.enqueued) * 1e3
                    job.future.set_exception(Expired(f"deadline passed after {waited:.0f} ms in the queue"))
                continue
            jobs.append(job)
            rows += job.request.rows
            tokens += job.tokens
        return jobs

    # ------------------------------------------------------------------ the scheduler

    async def _schedule(self) -> None:
        try:
            while await self._next_batch():
                pass
        except BaseException as err:  # a bug, or the loop being torn down: fail what waits
            if not isinstance(err, asyncio.CancelledError):
                log.exception("the batch scheduler stopped")
            self.stopped = err
            for queue in self._queues.values():
                while queue:
                    job = queue.popleft()
                    self._count(job, -1)
                    if not job.future.done():
                        job.future.set_exception(NotReady("model execution has stopped; see the server log"))
            self._on_stopped(err)
            if isinstance(err, asyncio.CancelledError):
                raise

    async def _next_batch(self) -> bool:
        """Runs one batch; False once closing and the queue is empty."""
        bucket = self._oldest_bucket()
        if bucket is None:
            if self._closing:
                return False
            self._wakeup.clear()
            await self._wakeup.wait()
            return True
        await self._gather(bucket)
        # The batch is taken once the lock is held, so requests that arrived while another
        # model ran join it, and deadlines are checked as late as possible.
        async with self.execution_lock:
            jobs = self._take(bucket)
            if not jobs:
                return True
            loop = asyncio.get_running_loop()
            try:
                run = await loop.run_in_executor(self._executor, self._in_turn, self._execute, jobs, loop)
            except Exception as err:  # noqa: BLE001 - delivered to each waiting request
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(err)
                return True
            finally:
                self._last_batch_jobs, self._last_batch_end = len(jobs), time.monotonic()
        loop.call_soon(self._record, run)  # after the callers have their answers
        return True

    def _record(self, run: BatchRun) -> None:
        try:
            self._on_batch(run)
        except Exception:  # noqa: BLE001 - bookkeeping must not stop execution
            log.exception("recording a batch failed; serving continues")

    @staticmethod
    def _deliver(jobs: list[Job], results: list[JobResult]) -> None:
        for job, result in zip(jobs, results, strict=True):
            if not job.future.done():  # the caller may have gone away meanwhile
                job.future.set_result(result)

    async def _gather(self, bucket: int) -> None:
        """Waits for batch-mates while the engine counts as busy (see the module docstring)."""
        if not self.batching:
            return
        just_ran = time.monotonic() - self._last_batch_end <= self.max_queue_delay_s
        expected = self._last_batch_jobs if just_ran else 1
        deadline = self._queues[bucket][0].enqueued + self.max_queue_delay_s
        while not self._closing and self._queued_jobs < expected and not self._full(bucket):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return
            if not self._queues[bucket]:  # its jobs were withdrawn
                return

    def _execute(self, jobs: list[Job], loop: asyncio.AbstractEventLoop) -> BatchRun:
        """Runs on the execution thread; hands the answers to the loop directly, one loop
        iteration sooner than through the scheduler."""
        engine = self.engine  # a hot swap replaces it between batches, never during one
        started = time.monotonic()
        seq_len = max(job.request.seq_len for job in jobs)
        ids, mask, types = pad_rows(jobs, seq_len)
        output = engine.execute(ids, mask, types)
        compute = time.monotonic() - started
        row_lengths = tuple(int(n) for n in mask.sum(axis=1))
        real_tokens = sum(row_lengths)
        run = BatchRun(
            rows=ids.shape[0],
            seq_len=seq_len,
            real_tokens=real_tokens,
            compute_seconds=compute,
            variants=engine.dispatch.variants(ids.shape[0], seq_len, real_tokens if engine.packed else None),
            row_lengths=row_lengths,
            packed=engine.packed,
        )
        results, start = [], 0
        for job in jobs:
            r = job.request
            stop = start + r.rows
            results.append(JobResult(output.rows(start, stop, r.seq_len), started - job.enqueued, run))
            start = stop
        loop.call_soon_threadsafe(self._deliver, jobs, results)
        return run
