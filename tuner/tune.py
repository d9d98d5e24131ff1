"""The tuning loop: DietCode's joint search over all shapes of one dynamic operator.

``Tuner.run`` runs the phases (``phases/``) in turn, each up to its share of the trial budget.
A phase proposes probes; the tuner measures them (built ahead where the runner can), appends
each to the records and keeps it in its ``Measurements``, which the phases and the planner
read. Records of this tuner version for the same workload and target are reused, not re-measured.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from dietserve.host.hardware import CpuHardware, GpuHardware
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space import task_space
from dietserve.kernels.space.analytic import MAX_INTERVALS

from .cost_model.model import CostModel, adapt
from .database.records import RecordDatabase, TuningRecord
from .measure.job import DEFAULT_APPLY, MeasureJob, MeasureResult, Runner
from .measure.timing import abandon_bar
from .measurements import Measurements, shape_key
from .phases import Phase, Probe
from .phases.commit import CommitPacking
from .phases.explore import Explore
from .phases.seed import Seed
from .phases.verify import Verify
from .planning import make_plan
from .planning.weight_stream import DramRates
from .progress import ProgressBar
from .search.evolution import EvolutionarySearch
from .task import TuningTask

TUNER_VERSION = 50  # bumped when the search, the kernels it times or its plans change: older plans are re-tuned
PACKING_SHARE = 3 / 8  # of the trial budget explored over every packing before one is committed


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 256  # micro-kernel measurements (each builds one candidate)
    time_budget_s: float | None = None
    candidates_per_round: int = 8
    shapes_per_round: int = 2
    max_variants: int = 4
    max_intervals: int = 8  # leaves of the decision tree (each is a scheduled copy in the code)
    loop_partition: bool = False
    # "module:function" applying a kernel, called as ``apply_kernel`` is
    apply: str = DEFAULT_APPLY
    seed: int = 0
    # Given, plans rank dense kernels as served, their weight from DRAM; None: as timed, cached.
    dram: DramRates | None = None
    # A tune measured elsewhere in rounds (``measure/bundle.py``): its trials counted from this
    # task's records, and this run, one round, ends after ``round_trials`` more.
    resume: bool = False
    round_trials: int | None = None

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"trials must be at least 1, got {self.trials}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time budget must be positive, got {self.time_budget_s}")
        if self.max_variants < 1 or self.candidates_per_round < 1 or self.shapes_per_round < 1:
            raise ValueError("max_variants, candidates_per_round and shapes_per_round must be positive")
        if self.round_trials is not None and self.round_trials < 1:
            raise ValueError(f"round_trials must be at least 1, got {self.round_trials}")


@dataclass
class TuneResult:
    plan: KernelPlan | None  # None: nothing measured yet (a round whose probes are all pending)
    trials: int
    failures: int
    wall_s: float
    pending: int = 0  # probes sent to be measured elsewhere: the plan is not final


class Tuner:
    def __init__(self, task: TuningTask, space: list[MicroKernel], cores: int, runner: Runner,
                 database: RecordDatabase, options: TuneOptions = TuneOptions(),
                 log: Callable[[str], None] = lambda _m: None, progress_stream=None,
                 hardware: CpuHardware | GpuHardware | None = None):
        self.task, self.runner, self.database, self.options = task, runner, database, options
        self.log, self.progress_stream, self.cores = log, progress_stream, cores
        self.model = CostModel(cores, options.seed)
        self.hardware = hardware
        self.space = task_space(space, task.spec.func, hardware)  # (``hardware``: the L2 a task block must fit)
        # Each packing's tallest register tile: how many rows a plan in it covers in one pass.
        self.tallest_tiles = {pack: max(k.tile_sizes("i")[0] for k in self.space if k.pack == pack)
                              for pack in {k.pack for k in self.space if k.pack > 0}}
        self.search = EvolutionarySearch(self.space, seed=options.seed)
        self.packing: int | None = None  # the committed panel width (``commit``); None: any
        self.rng = random.Random(options.seed)
        self.shapes, self.weights = task.shapes(), list(task.weights)
        self.store = Measurements(task, cores)
        self.trials = self.failures = self.reused = self.pending = 0
        self.check_shape = task.check_shape()  # (once: every job and record carries it)
        # The smallest shape: a regime of its own (weight streaming, no row reuse).
        self.smallest = min(range(len(self.shapes)), key=lambda i: task.dispatch_value(self.shapes[i]))
        records = self._reuse_records()
        self.trials = records if options.resume else 0  # (a round resumes where the records end)

    # -- what the phases read --------------------------------------------------------------
    def searchable(self, kernel: MicroKernel) -> bool:
        """A kernel the search still works for: of the committed packing, once there is one."""
        return self.packing is None or kernel.pack == self.packing

    def measured_here(self, shape: dict) -> list[float]:
        return [t for k, t in self.store.on(shape).items() if self.searchable(k)]

    def best_latency(self, shape: dict) -> float:
        """The best searchable kernel's latency on ``shape``: measured, else predicted (inf: neither)."""
        measured = self.measured_here(shape)
        if measured:
            return min(measured)
        known = {k: t for k, t in self.store.throughputs().items() if self.searchable(k)}
        extents, flops = self.task.axis_extents(shape), self.task.flops(shape)
        return min((flops / (thr * adapt(extents, k, self.cores)) for k, thr in known.items()), default=float("inf"))

    def by_cost(self) -> list[tuple[dict, float]]:
        """(shape, weight) of the shapes the traffic has, the costliest (weight x FLOPs) first."""
        pairs = enumerate(zip(self.shapes, self.weights, strict=True))
        costs = sorted(((w * self.task.flops(s), i) for i, (s, w) in pairs if w > 0), reverse=True)
        return [(self.shapes[i], self.weights[i]) for _cost, i in costs]

    def plan(self, provenance: dict | None = None) -> KernelPlan:
        """The best plan over the measurements so far, with this tune's provenance."""
        return make_plan(self.store, self.packing, self.options, self.tallest_tiles, {
            "tuner": TUNER_VERSION, "trials": self.trials, "reused_records": self.reused, "failures": self.failures,
            **(self.options.dram.describe() if self.options.dram else {}), **(provenance or {})})

    def commit(self, packing: int) -> None:
        """Search only kernels of ``packing`` from now on (those measured stay in the cost model)."""
        self.packing = packing
        self.space = [k for k in self.space if k.pack == packing]
        self.search = EvolutionarySearch(self.space, seed=self.options.seed + 1)
        self.log(f"{self.task.workload}: packing committed to {packing}-wide panels after {self.trials} trials"
                 f" ({len(self.space)} kernels read it)")

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> TuneResult:
        started = time.monotonic()
        bar = ProgressBar(self.options.trials, self.task.workload, stream=self.progress_stream)
        budget = self.options.trials
        final_check = budget // 8  # kept to verify the plan the later search leads to
        seeds = min(2 * MAX_INTERVALS, max(2, budget // 4))  # the cold start's kernels, each beside the default
        schedule: list[tuple[Phase, int]] = [
            (Seed(), self.trials + seeds), (Explore(), int(budget * PACKING_SHARE)),
            (CommitPacking(), budget - budget // 4), (Explore(), budget - budget // 4),
            (Verify(), budget - final_check), (Explore(), budget - final_check),
            (Verify(), budget), (Explore(), budget)]
        round_end = budget if self.options.round_trials is None else self.trials + self.options.round_trials
        for phase, until in schedule:
            self.run_phase(phase, min(until, round_end), started, bar)
        bar.close(self.trials, self.status())
        try:
            plan = self.plan({"tuning_seconds": round(time.monotonic() - started, 3),
                              "runner": self.runner.describe()})
        except RuntimeError:
            if not self.pending:
                raise
            plan = None
        return TuneResult(plan, self.trials, self.failures, time.monotonic() - started, self.pending)

    def run_phase(self, phase: Phase, until: int, started: float | None = None,
                  bar: ProgressBar | None = None) -> None:
        """Measure what ``phase`` proposes until it is done or ``until`` trials (or the time
        budget, counted from ``started``) are spent."""
        budget_s = self.options.time_budget_s
        started = time.monotonic() if started is None else started
        while self.trials < until:
            if budget_s is not None and time.monotonic() - started >= budget_s:
                self.log(f"time budget of {budget_s:.0f} s reached after {self.trials} trials")
                return
            probes = phase.propose(self, until)
            if not probes:
                return
            ahead = [p for p in probes[:until - self.trials] if p.kernel is not None]
            self.runner.prepare([self._job(p) for p in ahead if not self.store.has(p.kernel, p.shape)])
            results = []
            for probe in probes:
                if self.trials >= until:
                    break
                if not self.store.has(probe.kernel, probe.shape):
                    results.append((probe, self.measure(probe)))
                    if bar is not None:
                        bar.update(self.trials, self.status())
            phase.observe(self, results)

    def _job(self, probe: Probe, abandon_above_s: float | None = None) -> MeasureJob:
        return MeasureJob(recipe=self.task.spec.recipe, target=self.task.target, shapes=(dict(probe.shape),),
                          check_shape=self.check_shape, abandon_above_s=abandon_above_s,
                          kernel=None if probe.kernel is None else probe.kernel.to_json(),
                          apply=self.options.apply, loop_partition=self.options.loop_partition)

    def measure(self, probe: Probe) -> float | None:
        """Measure one probe, record it (append-only) and keep it; its seconds, or None where it
        failed. A candidate far behind its shape's best (the default kernel: the best measured or
        predicted) is timed once, not repeated."""
        if probe.kernel is None:
            best = self.best_latency(probe.shape)
        else:
            best = min(self.store.on(probe.shape).values(), default=float("inf"))
        result = self.runner.run(self._job(probe, abandon_bar(best)))
        self.trials += 1
        if result.pending:
            self.pending += 1
            self.store.pend(probe.kernel, probe.shape)
            return None
        self._record(probe, result)
        if not result.ok:
            self.failures += 1
            self.store.fail(probe.kernel)
            self.log(f"{probe.kernel or 'the default kernel'} failed on {dict(probe.shape)}: {result.error}")
            return None
        self.store.add(probe.kernel, probe.shape, result.latency)
        if probe.kernel is not None:
            self.model.add(probe.kernel, self.task.axis_extents(probe.shape), self.task.flops(probe.shape),
                           result.latency)
        return result.latency

    def _record(self, probe: Probe, result: MeasureResult) -> None:
        self.database.append(TuningRecord(
            workload=self.task.workload, target=self.task.target_key,
            kernel=DEFAULT_VARIANT if probe.kernel is None else probe.kernel.to_json(), shape=dict(probe.shape),
            latency_s=result.latency if result.ok else None, error=result.error,
            meta={"tuner": TUNER_VERSION, "runner": self.runner.describe(),
                  "time": time.time(), "flops": self.task.flops(probe.shape), "build_s": result.build_seconds,
                  "build_reused": result.build_reused, "check_shape": self.check_shape}))

    def _reuse_records(self) -> int:
        """Measurements already in the database for this workload and target, on our shapes, made
        by this version of the tuner. Returns how many records of this task there were."""
        ours = {shape_key(shape) for shape in self.shapes}
        count = 0
        for record in self.database.records():
            if record.workload != self.task.workload or record.target != self.task.target_key \
                    or record.meta.get("tuner") != TUNER_VERSION:
                continue
            count += 1
            kernel = None if record.kernel == DEFAULT_VARIANT else MicroKernel.from_json(record.kernel)
            shape = dict(record.shape_key())
            if not record.ok:
                self.store.fail(kernel)
            elif record.shape_key() in ours and (kernel is None or not self.store.has(kernel, shape)):
                self.store.add(kernel, shape, record.latency_s)
                if kernel is not None:
                    self.model.add(kernel, self.task.axis_extents(shape), self.task.flops(shape), record.latency_s)
                    self.reused += 1
        self.model.fit()
        return count

    def status(self) -> str:
        return f"| {len(self.store.measured_shapes())} shapes measured | {self.failures} failed"
