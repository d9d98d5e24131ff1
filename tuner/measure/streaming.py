"""Timing a dense layer as the served model runs it: its weight read from DRAM, not from cache.

A served BERT's weights are far larger than any cache, so each layer streams its weight from
DRAM while its activations are still cached; a kernel timed over and over on one weight finds it
in L2/L3 instead. With ``TimingPolicy(stream_weights=True)`` (``--stream-weights``) the worker
cycles each call through enough copies of the weight that none is cached when its turn comes.
It is off by default: the plan ranks kernels timed hot as served instead, by a model of the
stream (``planning/weight_stream.py``) fed the DRAM rate ``dram_read_rate`` measures.
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
