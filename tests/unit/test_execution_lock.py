"""Several models in one server: each has its own batcher, and one execution lock is shared
between them, so at most one model executes at a time and batches run in the order they became
ready (first come first served, which alternates between busy models)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from dietserve.runtime.batcher import DynamicBatcher
from dietserve.runtime.engine import EncoderOutput
from dietserve.runtime.request import EncoderRequest
from dietserve.runtime.variant_by_shape import KernelDispatch


class _Engine:
    """A stand-in for one model's VM that logs when each execution starts and ends; with a
    gate, each execution waits until the test opens it."""

    max_batch, max_seq_len = 8, 64
    packed = False

    def __init__(self, name: str, log: list, gate: threading.Event | None = None):
        self.name, self.log, self.gate = name, log, gate
        self.dispatch = KernelDispatch({})
        self.running = threading.Event()

    def execute(self, ids, mask, types):
        self.log.append(("start", f"{self.name}{ids[0, 0]}"))
        self.running.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        self.log.append(("end", f"{self.name}{ids[0, 0]}"))
        hidden = np.zeros((*ids.shape, 2), np.float32)
        return EncoderOutput(hidden, hidden.sum(axis=1))


def _request(value: int) -> EncoderRequest:
    ids = np.full((1, 4), value, np.int64)
    return EncoderRequest(ids, np.ones_like(ids), np.zeros_like(ids), ("sentence_embedding",))


def _batcher(engine: _Engine, lock: asyncio.Lock) -> DynamicBatcher:
    return DynamicBatcher(engine, batching=False, max_batch_size=1, max_queue_delay_s=0, bucket_ratio=1.5,
                          max_queue_rows=16, execution_lock=lock)


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


async def _settle() -> None:
    """Lets every task on the loop take its next step (a batcher reach the lock)."""
    for _ in range(10):
        await asyncio.sleep(0)


def _run_two_models(shared: bool) -> list:
    log: list = []
    gate = threading.Event()
    a_engine, b_engine = _Engine("a", log, gate), _Engine("b", log)

    async def scenario():
        lock = asyncio.Lock()
        a, b = _batcher(a_engine, lock), _batcher(b_engine, lock if shared else asyncio.Lock())
        a.start()
        b.start()
        a1 = asyncio.ensure_future(a.submit(_request(1)))
        await _until(a_engine.running.is_set)  # a executes (held at the gate)
        b1 = asyncio.ensure_future(b.submit(_request(1)))  # ready while a runs: waits for the lock
        await _settle()
        a2 = asyncio.ensure_future(a.submit(_request(2)))  # ready after b1
        b2 = asyncio.ensure_future(b.submit(_request(2)))
        await _settle()
        gate.set()
        await asyncio.gather(a1, b1, a2, b2)
        await asyncio.gather(a.close(), b.close())

    asyncio.run(scenario())
    return log


def test_models_sharing_the_lock_never_execute_at_once_and_take_turns_in_order_of_readiness():
    log = _run_two_models(shared=True)
    # b1 became ready while a1 ran, a2 after a1 (queued behind b1's batch), b2 after b1.
    assert log == [("start", "a1"), ("end", "a1"), ("start", "b1"), ("end", "b1"),
                   ("start", "a2"), ("end", "a2"), ("start", "b2"), ("end", "b2")]


def test_without_a_shared_lock_models_would_execute_at_once():
    # The same scenario with a lock each: b runs while a is still executing (what the shared
    # lock prevents), so the test above does check the lock.
    log = _run_two_models(shared=False)
    assert log.index(("start", "b1")) < log.index(("end", "a1"))


def test_run_between_batches_waits_for_another_model_s_execution():
    log: list = []
    gate = threading.Event()
    a_engine, b_engine = _Engine("a", log, gate), _Engine("b", log)

    async def scenario():
        lock = asyncio.Lock()
        a, b = _batcher(a_engine, lock), _batcher(b_engine, lock)
        a.start()
        b.start()
        a1 = asyncio.ensure_future(a.submit(_request(1)))
        await _until(a_engine.running.is_set)
        check = asyncio.ensure_future(b.run_between_batches(log.append, ("check", "b")))
        await _settle()
        gate.set()
        await asyncio.gather(a1, check)
        await asyncio.gather(a.close(), b.close())

    asyncio.run(scenario())
    assert log == [("start", "a1"), ("end", "a1"), ("check", "b")]
