"""Turns on the CPUs between a server's batches and a tuning job's timings
(``dietserve/host/cpu_turns.py``), between real processes: never both at once, and neither side
starved by the other taking its turns back to back."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from dietserve.host.cpu_turns import CpuTurns
from dietserve.runtime.batcher import DynamicBatcher
from dietserve.runtime.engine import EncoderOutput
from dietserve.runtime.request import EncoderRequest
from dietserve.runtime.variant_by_shape import KernelDispatch

# A process taking ``turns`` turns of ``hold_s`` each, back to back, writing when each began and
# ended (wall clock) as JSON.
TAKER = textwrap.dedent("""
    import json, sys, time
    from dietserve.host.cpu_turns import CpuTurns
    path, turns, hold_s, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    taker, spans = CpuTurns(path), []
    for _ in range(turns):
        with taker.turn():
            began = time.time()
            time.sleep(hold_s)
            spans.append((began, time.time()))
    open(out, "w").write(json.dumps(spans))
""")


def _taker(tmp_path: Path, name: str, turns: int, hold_s: float) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{name}.json"
    process = subprocess.Popen([sys.executable, "-c", TAKER, str(tmp_path / "cpu.turns"), str(turns), str(hold_s),
                                str(out)])
    return process, out


def test_two_processes_alternate_and_never_overlap(tmp_path: Path) -> None:
    """A side taking 40 turns back to back (the server's batches) and a side taking 10 (the
    tuner's timings): the second is done long before the first, each of its waits one turn of
    the other at most, and no two turns overlap."""
    busy, busy_out = _taker(tmp_path, "busy", 40, 0.02)
    time.sleep(0.3)  # the busy side already taking turns
    started = time.time()
    timer, timer_out = _taker(tmp_path, "timer", 10, 0.02)
    assert timer.wait(30) == 0 and busy.wait(30) == 0
    busy_spans, timer_spans = (json.loads(path.read_text()) for path in (busy_out, timer_out))
    spans = sorted(busy_spans + timer_spans)
    assert all(first[1] <= second[0] for first, second in zip(spans, spans[1:], strict=False))
    assert timer_spans[-1][1] < busy_spans[-1][1]  # not left waiting until the busy side stopped
    # Once it wants turns, turns alternate: between two of the timer's, at most one busy turn.
    during = [span for span in busy_spans if timer_spans[0][0] <= span[0] <= timer_spans[-1][0]]
    assert len(during) <= len(timer_spans), (len(during), started)


class _Engine:
    max_batch, max_seq_len, packed = 8, 64, False

    def __init__(self):
        self.dispatch = KernelDispatch({})
        self.started: list[float] = []

    def execute(self, ids, mask, types):
        self.started.append(time.monotonic())
        hidden = np.zeros((*ids.shape, 2), np.float32)
        return EncoderOutput(hidden, hidden.sum(axis=1))


def test_a_batch_waits_for_the_turn_another_process_holds(tmp_path: Path) -> None:
    engine = _Engine()
    holder, _ = _taker(tmp_path, "holder", 1, 0.5)
    time.sleep(0.2)  # the holder's turn has begun

    async def scenario():
        batcher = DynamicBatcher(engine, batching=False, max_batch_size=1, max_queue_delay_s=0, bucket_ratio=1.5,
                                 max_queue_rows=16, cpu_turns=CpuTurns(tmp_path / "cpu.turns"))
        batcher.start()
        ids = np.ones((1, 4), np.int64)
        submitted = time.monotonic()
        await batcher.submit(EncoderRequest(ids, np.ones_like(ids), np.zeros_like(ids), ("sentence_embedding",)))
        await batcher.close()
        return submitted

    submitted = asyncio.run(scenario())
    assert holder.wait(10) == 0
    assert engine.started[0] - submitted > 0.15  # ran only once the holder's turn ended
