"""The timing loop the end-to-end benchmarks share: wall-clock seconds of back-to-back calls, and
the summaries of their ratios."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence


def geomean(values) -> float:
    """The geometric mean of positive ``values``; NaN for none."""
    values = list(values)
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


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


def round_count(samples: dict[str, Sequence[float]], names: Sequence[str]) -> int:
    """The rounds every one of ``names`` has in ``samples`` (backend -> seconds per round): the
    same count for all, else a ValueError."""
    lengths = {len(samples[name]) for name in names}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"backends have different or no round counts: {sorted(lengths)}")
    return lengths.pop()


def busy_rounds(samples: dict[str, Sequence[float]], factor: float) -> list[int]:
    """The rounds of one point in which every backend ran at least ``factor`` times slower than
    in its own fastest round: the machine, not a backend, was slow then (backends of a point run
    one after another within a round, so a busy spell falls on all of them; a backend's own
    variation does not slow the others). ``samples``: backend -> seconds per round."""
    rounds = round_count(samples, list(samples))
    fastest = {name: min(values) for name, values in samples.items()}
    return [r for r in range(rounds) if all(values[r] >= factor * fastest[name] for name, values in samples.items())]


def rotated(items: Sequence, turn: int) -> list:
    """``items`` starting at ``turn`` (modulo their count): the order of a point's backends in its
    ``turn``-th round, so that each takes every place in turn (none always first or last; the
    cyclic order stays, so each still follows the same other one where it is not first)."""
    items = list(items)
    if not items:
        return items
    start = turn % len(items)
    return items[start:] + items[:start]


def paired_ratio(samples: dict[str, Sequence[float]], ours: str, rivals: Sequence[str]) -> float:
    """The median over rounds of (the fastest of ``rivals`` in a round) / (``ours`` in that
    round): each ratio is taken from runs seconds apart, so a slow spell of the machine that
    covers a round moves both sides of it, where a ratio of per-backend medians can take its two
    medians from different rounds. ``samples``: backend -> seconds per round."""
    rounds = round_count(samples, (ours, *rivals))
    per_round = [min(samples[name][r] for name in rivals) / samples[ours][r] for r in range(rounds)]
    return statistics.median(per_round)
