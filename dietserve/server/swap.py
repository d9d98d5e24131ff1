"""Hot swap: a server serving from a version store (``runtime/versions.py``) adopts a newer
version, or the one a rollback points at, without a failed or slowed request.

The candidate is loaded on a background thread, warmed up and checked on the execution thread
one model run at a time between batches. The check runs sample inputs through both versions: the
artifact's smallest shapes and the heaviest shape of the recorded traffic. It compares their
answers. A newer version is then timed against the served one, side by side on the traffic's
heaviest shapes (``time_side_by_side``): a re-tuning job times its kernels on cores the server
keeps busy, where serial kernels look as fast as parallel ones, so it can publish a version
slower than the served one. Only then does the batcher take the new engine for its next batch.
A candidate that fails to load, is incompatible, answers differently or is measured slower than
``HotSwap.min_gain`` of the served version's speed (in each of ``SPEED_READINGS`` readings) is
marked rejected in the store, counted and logged, and the current version stays. A rollback (the store's
current version set back by an operator, or another server's verified choice) is checked for its
answers, not timed: it is a decision already made.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..runtime.batcher import DynamicBatcher
from ..runtime.engine import Engine
from ..runtime.versions import VersionStore
from .metrics import ModelMetrics
from .traffic_log import TrafficLog

log = logging.getLogger("dietserve.server")

VERIFY_ATOL = 1e-3  # kernels may sum in another order; a wrong kernel is off by far more
# bf16 products (either version) round every layer's inputs to 8 bits, so kernels summing in
# another order round some of them the other way, and two bf16 builds differ by about a percent
# of the largest output value (docs/design/serving.md). The bar is a share of that value; a wrong
# kernel is off by the values themselves.
VERIFY_BF16_SHARE = 0.03
SAMPLE_SHAPES = ((1, 16), (4, 64))
TIMED_SHAPES = 3  # the traffic's heaviest shapes a candidate is timed on
# Runs per engine and shape: at least MIN_RUNS and MIN_SECONDS of them, at most MAX_RUNS. Medians
# of alternating runs, so that requests served meanwhile and a busy host slow both engines alike
# (tests/integration/test_hot_swap.py times two copies of one artifact so).
MIN_RUNS, MIN_SECONDS, MAX_RUNS = 5, 0.25, 40
# A reading below the minimum is timed again, up to this many readings in all, and the best one
# decides: a refusal stays in the store for good, and on a contended host one reading of two
# copies of one artifact can fall below the minimum. A version truly slower reads slow every time.
SPEED_READINGS = 2


@dataclass
class HotSwap:
    store: VersionStore
    version: int  # the version being served
    load_engine: Callable[[Path], Engine]
    watch_seconds: float = 5.0
    # A newer version measured below this fraction of the served version's speed is refused
    # (0: not timed). Below 1 so that noise does not refuse an equal one.
    min_gain: float = 0.9


def _speed_text(speed: float) -> str:
    """``speed`` rounded down to three decimals: a speed just below the minimum must not print as
    the minimum itself (0.8996 to two decimals reads as 0.90, "below the minimum 0.9")."""
    return f"{math.floor(speed * 1000) / 1000:.3f}x"


def _incompatibility(current: Engine, candidate: Engine) -> str | None:
    a, b = current.artifact.manifest, candidate.artifact.manifest
    for what, mine, theirs in (("model", a.model_config, b.model_config), ("maximum batch", a.max_batch, b.max_batch),
                               ("maximum sequence length", a.max_seq_len, b.max_seq_len),
                               ("target", a.target.get("kind"), b.target.get("kind")),
                               # clients read outputs and labels by name: they must not change under them
                               ("outputs", current.output_shapes, candidate.output_shapes),
                               ("labels", current.labels, candidate.labels)):
        if mine != theirs:
            return f"its {what} differs from the served version's ({theirs} vs {mine})"
    return None


def _within(engine: Engine, rows: int, length: int) -> tuple[int, int]:
    return min(rows, engine.max_batch), min(length, engine.max_seq_len)


def _heaviest(engine: Engine, traffic: TrafficLog, count: int) -> list[tuple[tuple[int, int], float]]:
    """The recorded traffic's ``count`` heaviest shapes (rows x length x executions), within the
    engine's bounds, with their executions."""
    weights: dict[tuple[int, int], float] = {}
    recorded = traffic.traffic
    for (rows, length), weight in recorded.execution_shapes() if engine.packed else recorded.weights.items():
        shape = _within(engine, rows, length)
        weights[shape] = weights.get(shape, 0.0) + weight
    return sorted(weights.items(), key=lambda item: -item[0][0] * item[0][1] * item[1])[:count]


def _token_ids(engine: Engine, shapes, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, min(engine.vocab_size, 20000), size=shape) for shape in shapes]


def sample_inputs(engine: Engine, traffic: TrafficLog) -> list[np.ndarray]:
    """What the answers are compared on: ``SAMPLE_SHAPES`` and the traffic's heaviest shape."""
    shapes = [_within(engine, *shape) for shape in SAMPLE_SHAPES]
    return _token_ids(engine, shapes + [shape for shape, _ in _heaviest(engine, traffic, 1)], seed=0)


def timed_inputs(engine: Engine, traffic: TrafficLog) -> list[tuple[np.ndarray, float]]:
    """(input, weight) for the timing: the traffic's ``TIMED_SHAPES`` heaviest shapes weighted by
    their executions; without traffic, ``SAMPLE_SHAPES`` alike."""
    shapes = _heaviest(engine, traffic, TIMED_SHAPES) or [(_within(engine, *shape), 1.0) for shape in SAMPLE_SHAPES]
    return list(zip(_token_ids(engine, [shape for shape, _ in shapes], seed=1), [w for _, w in shapes], strict=True))


def run_once(engine: Engine, ids: np.ndarray) -> float:
    """Seconds one model run takes (what the timing submits between batches)."""
    inputs = engine.validate(ids)  # every token attended, one segment
    started = time.perf_counter()
    engine.execute(*inputs)
    return time.perf_counter() - started


async def time_side_by_side(run_between_batches, current: Engine, candidate: Engine,
                            inputs: list[tuple[np.ndarray, float]]) -> tuple[float, list[str]]:
    """(the candidate's speed over the served version's, one line per shape): each shape run on
    both engines by turns, one run between batches, ``MIN_RUNS`` to ``MAX_RUNS`` times each;
    the speed is the weighted sum of median times, served / candidate."""
    served_total = candidate_total = 0.0
    lines = []
    for ids, weight in inputs:
        times: dict[int, list[float]] = {0: [], 1: []}
        engines = (current, candidate)
        for _ in range(MAX_RUNS):
            order = (0, 1) if len(times[0]) % 2 == 0 else (1, 0)  # neither always runs second
            for which in order:
                times[which].append(await run_between_batches(run_once, engines[which], ids))
            if len(times[0]) >= MIN_RUNS and min(sum(times[0]), sum(times[1])) >= MIN_SECONDS:
                break
        served, new = float(np.median(times[0])), float(np.median(times[1]))
        served_total += weight * served
        candidate_total += weight * new
        lines.append(f"{list(ids.shape)} {served * 1e3:.1f} -> {new * 1e3:.1f} ms ({len(times[0])} runs each)")
    return served_total / candidate_total, lines


async def best_reading(time_once, min_gain: float) -> tuple[float, list[str], list[float]]:
    """(speed, its lines, every speed read) of the best of up to ``SPEED_READINGS`` readings of
    ``time_once`` (an awaitable ``time_side_by_side``), read again only while below
    ``min_gain``."""
    readings, best = [], None
    for _ in range(SPEED_READINGS):
        speed, lines = await time_once()
        readings.append(speed)
        if best is None or speed > best[0]:
            best = (speed, lines)
        if speed >= min_gain:
            break
    return best[0], best[1], readings


def compare(current: Engine, candidate: Engine, ids: np.ndarray) -> str | None:
    """Runs one sample through both; the difference if they disagree (``VERIFY_ATOL``; where
    either computes bf16 products, ``VERIFY_BF16_SHARE`` of the largest value)."""
    inputs = current.validate(ids)  # every token attended, one segment
    want, got = current.execute(*inputs).named(), candidate.execute(*inputs).named()
    bf16 = "bf16" in (current.artifact.manifest.precision, candidate.artifact.manifest.precision)
    for name, a in want.items():  # an embedding model's outputs or a classifier's logits
        b = got[name]
        if not np.isfinite(b).all():
            return f"{name} at shape {list(ids.shape)} is not finite"
        error = float(np.abs(a - b).max())
        allowed = max(VERIFY_ATOL, VERIFY_BF16_SHARE * float(np.abs(a).max())) if bf16 else VERIFY_ATOL
        if error > allowed:
            return f"{name} at shape {list(ids.shape)} differs by up to {error:.3g} (allowed {allowed:.3g})"
    return None


class MeasuredGain:
    """Compute time per executed shape before and after the last swap: the gain a swap brought on
    the traffic that actually came (mean time before / after, weighted by executions after, over
    the shapes seen on both sides)."""

    def __init__(self, metrics: ModelMetrics):
        self.metrics = metrics
        self.before: dict[tuple[int, int], tuple[int, float]] = {}
        self.after: dict[tuple[int, int], tuple[int, float]] = {}

    def record(self, rows: int, seq_len: int, seconds: float) -> None:
        count, total = self.after.get((rows, seq_len), (0, 0.0))
        self.after[(rows, seq_len)] = (count + 1, total + seconds)

    def swapped(self) -> None:
        self.before, self.after = self.after, {}

    def publish(self) -> None:
        common = [shape for shape in self.after if shape in self.before]
        if not common:
            return
        weight = sum(self.after[shape][0] for shape in common)
        gain = sum(self.after[shape][0] * (self.before[shape][1] / self.before[shape][0])
                   / (self.after[shape][1] / self.after[shape][0]) for shape in common) / weight
        self.metrics.measured_gain.set(gain)


class Swapper:
    def __init__(self, swap: HotSwap, batcher: DynamicBatcher, models: dict, metrics: ModelMetrics,
                 traffic: TrafficLog, gain: MeasuredGain, say: Callable[[str], None]):
        self.swap, self.batcher, self.models, self.gain = swap, batcher, models, gain
        self.metrics, self.traffic, self.say = metrics, traffic, say
        metrics.artifact_version.labels(str(swap.version)).set(1)

    def candidate(self) -> tuple[int | None, bool]:
        """(the version to check, whether it is a decision already made: a rollback, or another
        server's verified choice, checked for its answers but not timed)."""
        store, serving = self.swap.store, self.swap.version
        current = store.current()
        if current is not None and current != serving and store.rejected(current) is None:
            return current, True
        return store.newer_candidate(serving), False

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.swap.watch_seconds)
            try:
                await self.try_swap()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one candidate
                log.exception("checking the version store failed; serving goes on")

    async def try_swap(self) -> bool:
        version, decided = self.candidate()
        if version is None:
            return False
        started = time.monotonic()
        store, loop = self.swap.store, asyncio.get_running_loop()
        current = self.batcher.engine
        self.say(f"version {version}: loading from {store.path(version)}")
        try:
            candidate = await loop.run_in_executor(None, self.swap.load_engine, store.path(version))
        except Exception as err:  # noqa: BLE001 - any load failure rejects the candidate
            return self._refuse(version, f"cannot be loaded: {err}")
        problem = await self._answers_differ(current, candidate)
        if problem is None and not decided and self.swap.min_gain > 0:
            problem = await self._too_slow(version, current, candidate)
        if problem:
            return self._refuse(version, problem)
        self._adopt(version, current, candidate, started)
        return True

    async def _answers_differ(self, current: Engine, candidate: Engine) -> str | None:
        problem = _incompatibility(current, candidate)
        for ids in [] if problem else sample_inputs(current, self.traffic):
            problem = await self.batcher.run_between_batches(compare, current, candidate, ids)
            if problem:
                break
        return problem

    async def _too_slow(self, version: int, current: Engine, candidate: Engine) -> str | None:
        """Times the candidate against the served version; why it is refused, if it is."""
        inputs = timed_inputs(current, self.traffic)
        try:
            speed, lines, readings = await best_reading(
                lambda: time_side_by_side(self.batcher.run_between_batches, current, candidate, inputs),
                self.swap.min_gain)
        except Exception as err:  # noqa: BLE001 - a run that fails at a traffic shape refuses the candidate
            return f"failed while timed on the traffic's shapes: {err}"
        self.metrics.checked_gain.set(speed)
        again = f"; the best of {len(readings)} readings: {', '.join(map(_speed_text, readings))}" \
            if len(readings) > 1 else ""
        self.say(f"version {version}: {_speed_text(speed)} the served version's speed, timed side by side "
                 f"({'; '.join(lines)}){again}")
        if speed < self.swap.min_gain:
            return (f"measured {_speed_text(speed)} the served version's speed on the traffic's shapes "
                    f"({'; '.join(lines)}{again}), below the minimum {self.swap.min_gain}")
        return None

    def _adopt(self, version: int, current: Engine, candidate: Engine, started: float) -> None:
        store = self.swap.store
        candidate.pool_bound = current.pool_bound  # one bound on the process, whichever engine runs
        self.batcher.engine = candidate  # the next batch runs on it
        self.gain.swapped()
        for model in self.models.values():
            model.engine, model.version = candidate, str(version)
        store.set_current(version)
        self.metrics.artifact_version.remove(str(self.swap.version))
        self.metrics.artifact_version.labels(str(version)).set(1)
        self.swap.version = version
        self.metrics.swaps.inc()
        self.metrics.swap_duration.set(time.monotonic() - started)
        predicted = store.retune_summary(version).get("predicted_gain")
        if isinstance(predicted, (int, float)):
            self.metrics.predicted_gain.set(predicted)
        self.say(f"version {version}: checked against the served version and swapped in "
                 f"({time.monotonic() - started:.1f} s)")

    def _refuse(self, version: int, reason: str) -> bool:
        self.swap.store.reject(version, reason)
        self.metrics.swap_failures.inc()
        log.error("version %d not swapped in: %s; version %d stays", version, reason, self.swap.version)
        return False
