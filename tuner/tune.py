"""The tuning loop: DietCode's joint search over all shapes of one dynamic operator.

Each round:
1. pick the shapes to work on by weighted priority ``weight x FLOPs / best throughput so far``
   (the weighted time the shape still costs), so every shape improves together;
2. for each, evolve micro-kernels under the cost model ``f_microkernel x f_adapt(shape)`` and
   measure the most promising not yet measured there (in a worker process, checked first);
3. record every measurement (append-only), retrain f_microkernel.
It stops at the trial budget or the time budget, then turns the measurements into a dispatch
plan: at most ``max_variants`` micro-kernels and a decision tree over the shape var.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .cost_model.model import CostModel, adapt
from .database.records import RecordDatabase, TuningRecord
from .dispatch import DispatchPlan, choose_variants, interval_tree
from .progress import ProgressBar
from .schedule import DEFAULT_APPLY
from .search.evolution import EvolutionarySearch
from .space.microkernel import MicroKernel
from .task import TuningTask

TUNER_VERSION = 1
ABANDON_FACTOR = 4.0  # a candidate this much slower than the shape's best is timed once, not repeated


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 256  # micro-kernel measurements (each builds one candidate)
    time_budget_s: float | None = None
    candidates_per_round: int = 8
    shapes_per_round: int = 2
    max_variants: int = 4
    loop_partition: bool = False
    apply: str = DEFAULT_APPLY  # "module:function" applying a kernel (a custom schedule)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"trials must be at least 1, got {self.trials}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time budget must be positive, got {self.time_budget_s}")
        if self.max_variants < 1 or self.candidates_per_round < 1 or self.shapes_per_round < 1:
            raise ValueError("max_variants, candidates_per_round and shapes_per_round must be positive")


@dataclass
class TuneResult:
    plan: DispatchPlan
    trials: int
    failures: int
    wall_s: float


def _key(shape: dict) -> tuple:
    return tuple(sorted(shape.items()))


def check_shape_for(task: TuningTask) -> dict:
    """A small shape whose var is prime, so no tile divides it: padding paths are exercised."""
    var = task.varying()
    values = sorted({dict(i)[var] for i in task.instances})
    primes = [v for v in values if v > 2 and all(v % d for d in range(2, int(math.isqrt(v)) + 1))]
    value = min(primes, key=lambda v: abs(v - 13)) if primes else values[len(values) // 2]
    return {**task.fixed, var: value}


class Tuner:
    def __init__(self, task: TuningTask, space: list[MicroKernel], cores: int, runner, database: RecordDatabase,
                 options: TuneOptions = TuneOptions(), log: Callable[[str], None] = lambda _m: None,
                 progress_stream=None):
        self.task = task
        self.runner = runner
        self.database = database
        self.options = options
        self.log = log
        self.progress_stream = progress_stream
        self.cores = cores
        self.model = CostModel(cores, options.seed)
        self.search = EvolutionarySearch(space, seed=options.seed)
        self.rng = random.Random(options.seed)
        self.shapes = task.shapes()
        self.weights = list(task.weights)
        self.measured: dict[tuple, dict[MicroKernel, float]] = defaultdict(dict)  # shape -> kernel -> latency
        self.failed: set[MicroKernel] = set()
        self.trials = 0
        self.failures = 0
        self.check_shape = check_shape_for(task)
        self._calibrated_cache: dict[MicroKernel, float] | None = None  # reset by each measurement

    # -- priorities ------------------------------------------------------------------------
    def _best_latency(self, shape: dict) -> float:
        measured = self.measured.get(_key(shape))
        if measured:
            return min(measured.values())
        return self._predicted_best(shape)

    def _predicted_best(self, shape: dict) -> float:
        known = self.calibrated()
        if not known:
            return float("inf")
        extents = self.task.axis_extents(shape)
        flops = self.task.flops(shape)
        return min(flops / (thr * adapt(extents, kernel, self.cores)) for kernel, thr in known.items())

    def _weighted(self) -> list[tuple[dict, float]]:
        return list(zip(self.shapes, self.weights, strict=True))

    def choose_shapes(self) -> list[dict]:
        priorities = np.asarray([w * self._best_latency(s) for s, w in self._weighted()])
        count = min(self.options.shapes_per_round, len(self.shapes))
        if np.isinf(priorities).any():  # cold start: shapes nobody has estimated, spread by weight x FLOPs
            scale = np.asarray([w * self.task.flops(s) for s, w in self._weighted()], dtype=float)
            picks = self._sample(scale, count)
        else:
            # The shape costing the most weighted time first; then shapes never measured, by
            # weight, so small shapes (cheap, but served as often) get kernels of their own
            # rather than extrapolations from kernels sized for large ones.
            first = int(np.argmax(priorities))
            unmeasured = np.asarray([0.0 if self.measured.get(_key(s)) else w for s, w in self._weighted()])
            unmeasured[first] = 0
            picks = [first] + self._sample(unmeasured, count - 1)
            if len(picks) < count:
                rest = priorities.copy()
                rest[picks] = 0
                picks += self._sample(rest, count - len(picks))
        return [self.shapes[i] for i in picks]

    def _sample(self, scale: np.ndarray, count: int) -> list[int]:
        positive = np.flatnonzero(scale > 0)
        if count <= 0 or positive.size == 0:
            return []
        probabilities = scale[positive] / scale[positive].sum()
        generator = np.random.default_rng(self.rng.randrange(1 << 30))
        return list(generator.choice(positive, size=min(count, positive.size), replace=False, p=probabilities))

    # -- measurements ----------------------------------------------------------------------
    def calibrated(self) -> dict[MicroKernel, float]:
        """Measured kernels' shape-independent throughput: median of flops/latency/f_adapt
        (computed once per new measurement, not per query)."""
        if self._calibrated_cache is None:
            self._calibrated_cache = self._calibrate()
        return self._calibrated_cache

    def _calibrate(self) -> dict[MicroKernel, float]:
        samples: dict[MicroKernel, list[float]] = defaultdict(list)
        for key, kernels in self.measured.items():
            shape = dict(key)
            extents = self.task.axis_extents(shape)
            flops = self.task.flops(shape)
            for kernel, latency in kernels.items():
                samples[kernel].append(flops / latency / adapt(extents, kernel, self.cores))
        return {kernel: statistics.median(values) for kernel, values in samples.items()}

    def estimate(self, kernel: MicroKernel, shape: dict) -> float:
        measured = self.measured.get(_key(shape), {}).get(kernel)
        if measured is not None:
            return measured
        throughput = self.calibrated().get(kernel)
        if throughput is None:
            return float("inf")
        return self.task.flops(shape) / (throughput * adapt(self.task.axis_extents(shape), kernel, self.cores))

    def measure(self, kernel: MicroKernel, shape: dict) -> None:
        job = {"recipe": self.task.spec.recipe, "target": self.task.target, "kernel": kernel.to_json(),
               "shapes": [shape], "check_shape": self.check_shape, "apply": self.options.apply,
               "loop_partition": self.options.loop_partition}
        best = self.measured.get(_key(shape))
        if best:
            job["abandon_above_s"] = ABANDON_FACTOR * min(best.values())
        result = self.runner.run(job)
        self.trials += 1
        latency = None
        error = result.get("error")
        if error is None:
            latency = next(iter(result["latencies"].values()))
            self.measured[_key(shape)][kernel] = latency
            self._calibrated_cache = None
            self.model.add(kernel, self.task.axis_extents(shape), self.task.flops(shape), latency)
        else:
            self.failures += 1
            self.failed.add(kernel)
            self.log(f"candidate {kernel} failed on {shape}: {error}")
        self.database.append(TuningRecord(
            workload=self.task.workload, target=self.task.target_key, kernel=kernel.to_json(), shape=shape,
            latency_s=latency, error=error,
            meta={"tuner": TUNER_VERSION, "runner": self.runner.describe(), "time": time.time(),
                  "flops": self.task.flops(shape),
                  "build_s": result.get("build_seconds"), "check_shape": self.check_shape},
        ))

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> TuneResult:
        started = time.monotonic()
        bar = ProgressBar(self.options.trials, self.task.workload, stream=self.progress_stream)
        while self.trials < self.options.trials:
            if self.options.time_budget_s is not None and time.monotonic() - started >= self.options.time_budget_s:
                self.log(f"time budget of {self.options.time_budget_s:.0f} s reached after {self.trials} trials")
                break
            shapes = self.choose_shapes()
            per_shape = max(1, self.options.candidates_per_round // len(shapes))
            for shape in shapes:
                extents, flops = self.task.axis_extents(shape), self.task.flops(shape)

                def score(kernels, extents=extents, flops=flops):
                    return -self.model.predict_latency(kernels, extents, flops)

                exclude = set(self.measured.get(_key(shape), {})) | self.failed
                seeds = sorted(self.calibrated(), key=lambda k, shape=shape: self.estimate(k, shape))[:16]
                for kernel in self.search.propose(score, per_shape, exclude, seeds):
                    if self.trials >= self.options.trials:
                        break
                    self.measure(kernel, shape)
                    bar.update(self.trials, self._status())
            self.model.fit()
        bar.close(self.trials, self._status())
        plan = self.plan()
        plan.meta.update({"trials": self.trials, "failures": self.failures,
                          "wall_s": round(time.monotonic() - started, 3), "runner": self.runner.describe()})
        return TuneResult(plan, self.trials, self.failures, time.monotonic() - started)

    def _status(self) -> str:
        measured = sum(1 for v in self.measured.values() if v)
        return f"| {measured} shapes measured | {self.failures} failed"

    def plan(self) -> DispatchPlan:
        kernels = list(self.calibrated())
        if not kernels:
            raise RuntimeError(f"no candidate of {self.task.workload} measured successfully in {self.trials} trials"
                               f" ({self.failures} failed); see the records for their errors")
        variants, assignment, latency = choose_variants(kernels, self.shapes, self.weights, self.estimate,
                                                        self.options.max_variants)
        names = [f"v{index}" for index in range(len(variants))]
        var = self.task.varying()
        tree = interval_tree(var, [s[var] for s in self.shapes], [names[a] for a in assignment])
        rows = [{"shape": s, "variant": names[a], "latency_s": lat,
                 "measured": variants[a] in self.measured.get(_key(s), {})}
                for s, a, lat in zip(self.shapes, assignment, latency, strict=True)]
        return DispatchPlan(self.task.workload, self.task.target_key, var,
                            {n: k.to_json() for n, k in zip(names, variants, strict=True)}, tree, rows)
