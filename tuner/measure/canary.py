"""Timings taken in a slow spell of the machine, taken again.

A cloud CPU is a slice of a shared host: for seconds at a time a neighbour takes part of one of
our cores. A kernel split evenly over the cores then waits for its slowest part: the same
768 -> 3072 layer at T = 512, with the same arguments, timed 11.3 ms and 16-24 ms a few seconds
apart (2-core znver4, 2026-11-25). A candidate timed in such a spell looks slow and the search
drops it: an AVX2 tune of the attention scores during one kept 9-row tiles at 126 GFLOP/s
where four tunes an hour later found tiles at 200-218.

The canary is a small fixed kernel on every core, 40-100 us of multiply-adds in registers (no
memory traffic: only the cores' speed moves it). The worker times it right before and after
each timing; its fastest reading over the worker's life is the machine at rest. Where a
reading is ``SPELL_RATIO`` x that or more, the timing is taken again after a pause
(``gated``), up to ``RETRIES`` times, and the fastest attempt is kept: a spell only ever slows
a kernel down. Records count the attempts spoiled (``spells``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

SPELL_RATIO = 1.2
RETRIES = 3
PAUSE_S = 0.5  # before a retry: spells last seconds, this lets a short one pass
ACCUMULATORS = 8  # independent FMA chains per core: enough to fill both FMA pipes (latency 4)
STEPS = 16384  # multiply-adds per chain: 40-100 us a call, well above a pool's wake-up


def canary_func(cores: int, lanes: int):
    """A PrimFunc with ``cores`` parallel tasks, each running ``ACCUMULATORS`` chains of
    ``STEPS`` ``lanes``-wide multiply-adds in registers, then storing them."""
    from tvm.script import tirx as T

    width = ACCUMULATORS * lanes

    @T.prim_func
    def canary(seed: T.Buffer((cores, width), "float32"), out: T.Buffer((cores, width), "float32")):
        for core in T.parallel(cores):
            acc = T.alloc_buffer((ACCUMULATORS, lanes), "float32", scope="local")
            for a, lane in T.grid(ACCUMULATORS, lanes):
                acc[a, lane] = seed[core, a * lanes + lane]
            for _step in range(STEPS):
                for a in T.unroll(ACCUMULATORS):
                    for lane in T.vectorized(lanes):
                        acc[a, lane] = acc[a, lane] * T.float32(0.999) + T.float32(0.001)
            for a, lane in T.grid(ACCUMULATORS, lanes):
                out[core, a * lanes + lane] = acc[a, lane]

    return canary.with_attr("global_symbol", "canary")


class Canary:
    """The canary built for this machine and its fastest reading so far."""

    def __init__(self, target, cores: int, lanes: int, warmup: int = 5):
        import numpy as np
        import tvm

        from dietserve.kernels.build import build

        self.cores = cores
        self.function = build(canary_func(cores, lanes), target).jit()["canary"]
        seed = np.ones((cores, ACCUMULATORS * lanes), "float32")
        self.arguments = [tvm.runtime.tensor(seed), tvm.runtime.tensor(np.zeros_like(seed))]
        self.best = float("inf")
        for _ in range(warmup):
            self.time()

    def time(self) -> float:
        """Seconds of one call (the fastest of three back to back: the first may wake the pool)."""
        fastest = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            self.function(*self.arguments)
            fastest = min(fastest, time.perf_counter() - start)
        self.best = min(self.best, fastest)
        return fastest

    def slow(self, reading: float) -> bool:
        return reading >= SPELL_RATIO * self.best


def gated(timing: Callable[[], float], canary: Canary | None, retries: int = RETRIES,
          pause_s: float = PAUSE_S) -> tuple[float, int]:
    """(``timing()``, taken again while the canary reads a spell before or after it, the fastest
    attempt; how many attempts a spell spoiled). Without a canary, one plain attempt."""
    if canary is None:
        return timing(), 0
    values, spells = [], 0
    for attempt in range(retries + 1):
        before = canary.time()
        values.append(timing())
        after = canary.time()
        if not (canary.slow(before) or canary.slow(after)):
            break
        spells += 1
        if attempt < retries:
            time.sleep(pause_s)
    return min(values), spells
