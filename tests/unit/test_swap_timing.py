"""The hot swap's speed check: which shapes a candidate is timed on, and how its runs become one
speed ratio. The engines here are stand-ins that sleep a set time per run (the aggregation is
what is tested); ``tests/integration/test_hot_swap.py`` times real artifacts in a real server."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from dietserve.server import swap
from dietserve.server.metrics import ServerMetrics
from dietserve.server.traffic_log import TrafficLog


class SleepingEngine:
    def __init__(self, seconds: float):
        self.seconds, self.runs, self.shapes = seconds, 0, []

    def validate(self, ids):
        return ids, np.ones_like(ids), np.zeros_like(ids)

    def execute(self, ids, mask, token_types):
        assert ids.shape == mask.shape == token_types.shape
        self.runs += 1
        self.shapes.append(ids.shape)
        time.sleep(self.seconds)


def _traffic(shapes: dict[tuple[int, int], int]) -> TrafficLog:
    log = TrafficLog(None, 3600.0, ServerMetrics().for_model("m"))
    for (rows, length), count in shapes.items():
        for _ in range(count):
            log.traffic.record(rows, length, now=log.traffic.as_of)
    return log


def test_the_traffics_heaviest_shapes_are_timed_within_the_engines_bounds() -> None:
    engine = SimpleNamespace(max_batch=8, max_seq_len=128, vocab_size=30522, packed=False)
    # rows x length x executions: (1, 300) clamps to (1, 128) = 128 x 5 = 640, then 16 x 20 = 320,
    # 8 x 64 x 1 = 512 (rows clamped from 32); (1, 8) x 30 = 240 is the lightest, left out.
    traffic = _traffic({(1, 300): 5, (1, 16): 20, (32, 64): 1, (1, 8): 30})
    inputs = swap.timed_inputs(engine, traffic)
    assert [(ids.shape, round(w, 3)) for ids, w in inputs] == [((1, 128), 5.0), ((8, 64), 1.0), ((1, 16), 20.0)]
    assert all(ids.dtype == np.int64 and ids.min() >= 1000 for ids, _ in inputs)
    without = swap.timed_inputs(engine, _traffic({}))
    assert [ids.shape for ids, _ in without] == [(1, 16), (4, 64)] and {w for _, w in without} == {1.0}


def test_a_packed_engine_is_timed_at_the_batches_it_ran() -> None:
    """A packed server records each row at its own length and each execution's tokens: 10
    executions of 8 rows of 30-40 tokens are timed as 8 full rows of 35 tokens, not as single
    rows; without packing the same record times its rows."""
    log = TrafficLog(None, 3600.0, ServerMetrics().for_model("m"))
    for _ in range(10):
        log.traffic.record_packed((30, 32, 34, 36, 36, 38, 38, 36), now=log.traffic.as_of)  # 280 tokens
    for _ in range(5):
        log.traffic.record_packed((12,), now=log.traffic.as_of)  # a lone short text
    packed = SimpleNamespace(max_batch=16, max_seq_len=128, vocab_size=30522, packed=True)
    inputs = swap.timed_inputs(packed, log)
    # the rows' mean length: (80 rows x 35 + 5 x 12) / 85 = 33.6 -> 34: 280 tokens are 8 rows of 35
    assert [(ids.shape, round(w, 3)) for ids, w in inputs] == [((8, 35), 10.0), ((1, 12), 5.0)]
    padded = SimpleNamespace(max_batch=16, max_seq_len=128, vocab_size=30522, packed=False)
    assert all(ids.shape[0] == 1 for ids, _ in swap.timed_inputs(padded, log))


def test_the_speed_is_the_weighted_sum_of_median_times_served_over_candidate() -> None:
    served, candidate = SleepingEngine(0.004), SleepingEngine(0.002)
    between: list[str] = []

    async def run_between_batches(function, *args):
        between.append(function.__name__)  # one model run per call, as the batcher runs it
        return function(*args)

    inputs = [(np.full((1, 16), 1000, np.int64), 3.0), (np.full((2, 8), 1000, np.int64), 1.0)]
    speed, lines = asyncio.run(swap.time_side_by_side(run_between_batches, served, candidate, inputs))
    assert speed == pytest.approx(2.0, rel=0.25)
    assert served.runs == candidate.runs and swap.MIN_RUNS * 2 <= served.runs <= swap.MAX_RUNS * 2
    assert set(between) == {"run_once"} and len(between) == served.runs * 2
    assert len(lines) == 2 and lines[0].startswith("[1, 16] ") and "runs each" in lines[0]
    # Short runs repeat until each engine has spent MIN_SECONDS on the shape, at most MAX_RUNS times:
    # the faster candidate would need more than MAX_RUNS.
    assert served.shapes.count((2, 8)) == candidate.shapes.count((2, 8)) == swap.MAX_RUNS
    slow = SleepingEngine(0.06)
    asyncio.run(swap.time_side_by_side(run_between_batches, slow, SleepingEngine(0.06), inputs[:1]))
    assert slow.runs == swap.MIN_RUNS  # MIN_RUNS runs last over MIN_SECONDS: both minimums met


@pytest.mark.parametrize("speed, text", [(0.8996, "0.899x"), (0.9, "0.900x"), (1.2345, "1.234x"), (2.0, "2.000x")])
def test_a_speed_below_the_minimum_never_prints_as_the_minimum(speed, text):
    # To two decimals 0.8996 would print as the minimum 0.9 it is refused below; rounded down, it cannot.
    assert swap._speed_text(speed) == text


@pytest.mark.parametrize("readings, read, decides", [
    ([1.01], [1.01], 1.01),  # at or above the minimum: read once
    ([0.856, 0.99], [0.856, 0.99], 0.99),  # one slow reading (a contended host): read again, swapped
    ([0.55, 0.6], [0.55, 0.6], 0.6),  # slow every time: refused on the better reading
    ([0.5, 0.7, 1.2], [0.5, 0.7], 0.7),  # at most SPEED_READINGS
])
def test_a_reading_below_the_minimum_is_read_again_and_the_best_decides(readings, read, decides) -> None:
    assert swap.SPEED_READINGS == 2
    script = iter(readings)

    async def time_once():
        speed = next(script)
        return speed, [f"line of {speed}"]

    speed, lines, every = asyncio.run(swap.best_reading(time_once, min_gain=0.9))
    assert (speed, lines, every) == (decides, [f"line of {decides}"], read)
