"""How a candidate is timed: the median of ``repeat`` repeats, each at least ``min_repeat_ms`` long
(over a few calls a short kernel times its thread pool's wake-up). A first warm call over the job's
abandon bar cannot win and is kept as the time, as tinygrad's search stops early. Weights stay in
cache; plans rank kernels as served, from DRAM, by a model (``planning/weight_stream.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dietserve.host.cpu_turns import cpu_turn

ABANDON_FACTOR = 4.0  # a candidate this much slower than its shape's best is timed once


def abandon_bar(best_s: float) -> float | None:
    """The abandon bar of a candidate on a shape whose best known time is ``best_s`` (None: no bar)."""
    return ABANDON_FACTOR * best_s if best_s < float("inf") else None


@dataclass(frozen=True)
class TimingPolicy:
    number: int = 2  # calls per timed repeat, at least
    repeat: int = 3  # timed repeats; the median is kept
    min_repeat_ms: int = 10  # a repeat lasts at least this long
    # Given, a lock file shared with a server on this machine: each candidate is timed in a turn
    # of the CPUs between its batches (``dietserve/host/cpu_turns.py``).
    cpu_turns: str | None = None

    def __post_init__(self) -> None:
        if self.number < 1 or self.repeat < 1 or self.min_repeat_ms < 0:
            raise ValueError(f"number and repeat must be positive and min_repeat_ms >= 0, got {self}")

    def time(self, module, device, arguments: Sequence, abandon_above_s: float | None, local: bool) -> float:
        """Median seconds per call of ``module["main"](*arguments)`` by TVM's evaluator (the
        device's clock for a GPU or over RPC); on this machine (``local``) after a warm call,
        in a turn of the CPUs where they are shared with a server."""
        with cpu_turn(self.cpu_turns if local else None):
            return self._time(module, device, arguments, abandon_above_s, local)

    def _time(self, module, device, arguments: Sequence, abandon_above_s: float | None, local: bool) -> float:
        if local:
            function = module["main"]
            function(*arguments)  # warm-up: caches, page faults, the thread pool
            start = time.perf_counter()
            function(*arguments)
            probe = time.perf_counter() - start
            if abandon_above_s is not None and probe > abandon_above_s:
                return probe
        evaluator = module.time_evaluator("main", device, number=self.number, repeat=self.repeat,
                                          min_repeat_ms=self.min_repeat_ms)
        return float(statistics.median(evaluator(*arguments).results))
