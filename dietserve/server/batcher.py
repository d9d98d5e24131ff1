"""Dynamic batching by sequence-length bucket, run off the gRPC event loop.

Requests queue per bucket. The scheduler takes the bucket whose head waited longest, lets it
gather batch-mates until it holds ``max_batch_size`` rows or its head has waited
``max_queue_delay``, pads the rows to the batch's longest sequence and runs them in one model
execution on a dedicated worker thread. One execution runs at a time (the VM is not re-entrant,
and on a CPU it already uses every core); requests arriving meanwhile form the next batch.
Buckets grow geometrically, so a batch's padding is under ``1 - 1/ratio`` of its tokens.
With batching off every request runs alone, in arrival order.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..runtime.engine import EncoderOutput, Engine
from .requests import EncoderRequest


class QueueFull(Exception):
    """More rows are waiting than the server allows."""


def bucket_edges(max_seq_len: int, ratio: float, granularity: int = 8) -> list[int]:
    """Upper edges: 8, 16, 24, 32, 40, 56, ... (each ~``ratio`` times the last, rounded up to
    ``granularity``), ending at ``max_seq_len``."""
    edges, edge = [], granularity
    while edge < max_seq_len:
        edges.append(edge)
        edge = max(edge + granularity, -(-int(edge * ratio) // granularity) * granularity)
    edges.append(max_seq_len)
    return edges


@dataclass
class Job:
    request: EncoderRequest
    bucket: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    started: float = 0.0


@dataclass(frozen=True)
class BatchRun:
    """What one model execution did, for metrics and statistics."""

    rows: int
    seq_len: int
    real_tokens: int
    compute_seconds: float
    variants: tuple[tuple[str, str], ...]


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
        on_queue_change=None,
        on_batch=None,
    ):
        self.engine = engine
        self.batching = batching
        self.max_batch_size = min(max_batch_size, engine.max_batch) if batching else 1
        self.max_queue_delay_s = max_queue_delay_s if batching else 0.0
        self.max_queue_rows = max_queue_rows
        self.edges = bucket_edges(engine.max_seq_len, bucket_ratio) if batching else [engine.max_seq_len]
        self._queues: dict[int, deque[Job]] = {}
        self._queued_rows = 0
        self._on_queue_change = on_queue_change or (lambda rows: None)
        self._on_batch = on_batch or (lambda run: None)
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
        return self.edges[bisect.bisect_left(self.edges, seq_len)]

    async def submit(self, request: EncoderRequest) -> JobResult:
        if self._closing:
            raise QueueFull("the server is shutting down")
        if self._queued_rows + request.rows > self.max_queue_rows:
            raise QueueFull(
                f"queue full: {self._queued_rows} rows are waiting (limit {self.max_queue_rows}); retry later"
            )
        job = Job(request, self.bucket_of(request.seq_len), asyncio.get_running_loop().create_future())
        self._queues.setdefault(job.bucket, deque()).append(job)
        self._queued_rows += request.rows
        self._on_queue_change(self._queued_rows)
        self._wakeup.set()
        return await job.future

    async def close(self) -> None:
        """Runs what is queued, then stops."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    def _oldest_bucket(self) -> int | None:
        heads = [(queue[0].enqueued, bucket) for bucket, queue in self._queues.items() if queue]
        return min(heads)[1] if heads else None

    def _rows_in(self, bucket: int) -> int:
        return sum(job.request.rows for job in self._queues[bucket])

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            bucket = self._oldest_bucket()
            if bucket is None:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            deadline = self._queues[bucket][0].enqueued + self.max_queue_delay_s
            while not self._closing and self._rows_in(bucket) < self.max_batch_size:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
            jobs = self._take(bucket)
            try:
                results = await loop.run_in_executor(self._executor, self._execute, jobs)
            except Exception as err:  # noqa: BLE001 - delivered to each waiting request
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(err)
                continue
            self._on_batch(results[0].run)
            for job, result in zip(jobs, results, strict=True):
                if not job.future.done():  # the client may have gone away
                    job.future.set_result(result)

    def _take(self, bucket: int) -> list[Job]:
        queue = self._queues[bucket]
        jobs = [queue.popleft()]  # always at least one, even if it alone exceeds max_batch_size
        rows = jobs[0].request.rows
        while queue and rows + queue[0].request.rows <= self.max_batch_size:
            rows += queue[0].request.rows
            jobs.append(queue.popleft())
        self._queued_rows -= rows
        self._on_queue_change(self._queued_rows)
        return jobs

    def _execute(self, jobs: list[Job]) -> list[JobResult]:
        started = time.perf_counter()
        seq_len = max(job.request.seq_len for job in jobs)
        ids, mask, types = pad_rows(jobs, seq_len)
        output = self.engine.execute(ids, mask, types)
        compute = time.perf_counter() - started
        run = BatchRun(
            rows=ids.shape[0],
            seq_len=seq_len,
            real_tokens=sum(job.request.rows * job.request.seq_len for job in jobs),
            compute_seconds=compute,
            variants=self.engine.dispatch.variants(ids.shape[0], seq_len),
        )
        results, start = [], 0
        for job in jobs:
            r = job.request
            stop = start + r.rows
            hidden = output.last_hidden_state[start:stop, : r.seq_len]
            results.append(JobResult(EncoderOutput(hidden, output.sentence_embedding[start:stop]),
                                     started - job.enqueued, run))
            start = stop
        return results
