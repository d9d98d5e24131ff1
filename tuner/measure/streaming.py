"""Timing a dense layer as the served model runs it: its weight read from DRAM, not from cache.

A served BERT's weights (340 MB for bert-base) are far larger than any cache, so each layer
streams its weight from DRAM while its activations, written by the layer before, are still
cached. A kernel timed over and over on one weight finds it in L2/L3 instead, and at short
sequences that picks the wrong kernel: on the 3072 -> 768 layer at T = 7 (2-core znver4) the
kernel fastest with a cached weight (7-row tiles, 256-deep reduction blocks: 0.163 ms) takes
0.325 ms with the weight from DRAM, where a 7-row tile over the whole reduction, as fast in
cache, takes 0.267 ms (it overlaps the stream with its FMAs in one pass).

With ``MeasureOptions(stream_weights=True)`` (``python -m tuner ... --stream-weights``) the
worker cycles each call through enough copies of the weight that none is cached when its turn
comes (``copies``), calls back to back so the thread pool stays awake as in the model, and
reports the time per call.

It is off by default because, measured end to end, it did not pay: bert-base tuned twice each
way (64 trials per operator) and timed side by side (``tests/benchmarks/compare_artifacts.py``,
seq 1..256) ran at 0.97-0.98x of a cached-weight tune's speed, another cached-weight tune at
1.01x. The per-kernel gap at T = 7 is within what two tunes of either kind differ by.
The plan instead ranks kernels timed hot as served, by a model of the stream
(``tuner/weight_stream.py``), fed the DRAM rate ``dram_read_rate`` measures.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

CACHE_MULTIPLE = 2  # the copies together span this many times the last-level cache
UNKNOWN_CACHE_BYTES = 64 * 1024 * 1024  # assumed when the machine does not describe its caches


def copies(weight_bytes: int, cache_bytes: int | None) -> int:
    """How many copies of a ``weight_bytes`` weight to cycle through so that each call finds
    its copy evicted: together they span ``CACHE_MULTIPLE`` x the last-level cache."""
    if weight_bytes <= 0:
        raise ValueError(f"weight size must be positive, got {weight_bytes}")
    span = CACHE_MULTIPLE * (cache_bytes or UNKNOWN_CACHE_BYTES)
    return max(2, math.ceil(span / weight_bytes))


def time_streaming(function: Callable, argument_sets: Sequence[Sequence], repeat: int,
                   min_repeat_s: float) -> float:
    """Median seconds per call of ``function`` over ``repeat`` repeats, each a pass (or more,
    to last ``min_repeat_s``) over every argument set in turn, back to back."""
    if not argument_sets or repeat < 1:
        raise ValueError("need at least one argument set and one repeat")
    for arguments in argument_sets:  # first touch of every copy: page faults, the pool's wake-up
        function(*arguments)
    samples = []
    for _repeat in range(repeat):
        calls = 0
        start = time.perf_counter()
        while True:
            for arguments in argument_sets:
                function(*arguments)
            calls += len(argument_sets)
            elapsed = time.perf_counter() - start
            if elapsed >= min_repeat_s:
                break
        samples.append(elapsed / calls)
    return statistics.median(samples)


class SharedCycle:
    """Calls of several kernels on weights fresh from DRAM, timed in turn (a race): one cursor
    over the weight copies for all of them, so a copy comes round again only after every other
    copy was read, whichever kernel reads it, and a turn makes only as many calls as fill
    ``min_turn_s`` (a kernel of 6 ms makes two, not a pass over all its copies)."""

    def __init__(self, min_turn_s: float):
        self.min_turn_s = min_turn_s
        self.cursor = 0

    def turn(self, function: Callable, argument_sets: Sequence[Sequence]) -> float:
        """Seconds per call of ``function`` over one turn, on the next argument sets in the cycle."""
        calls = 0
        start = time.perf_counter()
        while True:
            function(*argument_sets[self.cursor % len(argument_sets)])
            self.cursor += 1
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= self.min_turn_s:
                return elapsed / calls


def dram_read_rate(threads: int, cache_bytes: int | None, repeat: int = 5) -> float:
    """Bytes per second of a read-only pass over a buffer of ``CACHE_MULTIPLE`` x the last-level
    cache, split over ``threads`` threads (numpy's reductions release the GIL): the rate at which
    the served model's layers can stream their weights. Median of ``repeat`` passes."""
    import numpy as np

    if threads < 1 or repeat < 1:
        raise ValueError(f"need at least one thread and one repeat, got {threads} and {repeat}")
    span = CACHE_MULTIPLE * (cache_bytes or UNKNOWN_CACHE_BYTES)
    data = np.ones(span // 8, dtype=np.int64)  # (integer sums: no float rounding work per element)
    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # first touch of the pages
        samples = []
        for _repeat in range(repeat):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            samples.append(data.nbytes / (time.perf_counter() - start))
    return statistics.median(samples)
