"""The machine's DRAM read rate: what the served model's dense layers stream their weights at,
for plans that rank kernels as served (``planning/weight_stream.py``)."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

CACHE_MULTIPLE = 2  # the buffer read spans this many times the last-level cache
UNKNOWN_CACHE_BYTES = 64 * 1024 * 1024  # assumed when the machine does not describe its caches


def dram_read_rate(threads: int, cache_bytes: int | None, repeat: int = 5) -> float:
    """Bytes per second, the median of ``repeat`` read-only passes over ``CACHE_MULTIPLE`` x the
    last-level cache, split over ``threads`` threads (numpy's reductions release the GIL)."""
    import numpy as np

    if threads < 1 or repeat < 1:
        raise ValueError(f"need at least one thread and one repeat, got {threads} and {repeat}")
    span = CACHE_MULTIPLE * (cache_bytes or UNKNOWN_CACHE_BYTES)
    data = np.ones(span // 8, dtype=np.int64)  # integer sums: no float rounding work per element
    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # first touch of the pages
        samples = []
        for _repeat in range(repeat):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            samples.append(data.nbytes / (time.perf_counter() - start))
    return statistics.median(samples)
