"""The timing loop the end-to-end benchmarks share: wall-clock seconds of back-to-back calls."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def call_seconds(fn: Callable, args: Sequence = (), runs: int = 10, warmup: int = 0) -> list[float]:
    """Seconds each of ``runs`` calls of ``fn(*args)`` took, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn(*args)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    return samples
