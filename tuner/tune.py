"""The tuning loop: DietCode's joint search over all shapes of one dynamic operator.

Each round:
1. pick the shapes to work on by weighted priority ``weight x FLOPs / best throughput so far``
   (the weighted time the shape still costs), so every shape improves together;
2. for each, evolve micro-kernels under the cost model ``f_microkernel x f_adapt(shape)`` and
   measure the most promising not yet measured there (in a worker process, checked first);
3. record every measurement (append-only), retrain f_microkernel.
Operators whose weight is packed (CPU dense layers) choose the packing first: the first
rounds search every panel width, then the packing the plan would take is committed and the
rest of the budget searches only kernels that read it (a plan reads one packing, so a kernel
of another can never be dispatched; ``commitment.py``, with the plan's verification); an
unpacked space (attention) measures every column-tile width there instead. It
stops at the trial budget or the time budget, then turns the measurements into a dispatch
plan (``planning.py``): at most ``max_variants`` micro-kernels (and one for the smallest shape's regime, and
those covering short shapes' rows in one pass over the weight) and a decision tree over the
operator's row count.
The default rule's kernel (what an untuned build runs) is measured on every shape the search
works on and stays a candidate, so the plan never loses to it where both were measured.
Before the final plan, each measured shape's finalists (the kernels within ``race.RACE_MARGIN``
of its best) are timed again side by side (``race.py``): the search times each candidate once,
and on a shared host kernels a few per cent apart were ranked by when each was timed.
Records already in the database for the same workload and target, made by this version of the
tuner, are reused, not re-measured.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from dietserve.kernels.hardware import CpuHardware, GpuHardware
from dietserve.kernels.microkernel import MicroKernel
from dietserve.kernels.plan import DEFAULT_VARIANT, KernelPlan

from .commitment import PlanCommitment
from .cost_model.model import CostModel, adapt
from .database.records import RecordDatabase, TuningRecord
from .dispatch import shape_key
from .measure.host_load import CONTENDED_SHARE
from .options import TuneOptions, TuneResult
from .planning import make_plan
from .progress import ProgressBar
from .race import RaceSummary, race_finalists, race_packings, race_unmeasured_intervals
from .reference_scale import ReferenceScale
from .search.evolution import EvolutionarySearch
from .shape_choice import choose_shapes
from .space import task_space
from .task import TuningTask

TUNER_VERSION = 48  # bumped when the search, the kernels it times or its plans change: older plans are re-tuned
ABANDON_FACTOR = 4.0  # a candidate this much slower than the shape's best is timed once, not repeated
DEFAULT_OPTIONS = TuneOptions()  # (frozen: one shared default)
PACKING_SHARE = 3 / 8  # of the trial budget searched over every packing before one is committed


def _abandoning(job: dict, best_s: float) -> dict:
    """``job``, told to time its kernel once where it runs ``ABANDON_FACTOR`` x ``best_s`` (the
    best latency known on its shape; infinite: none known, every repeat)."""
    return {**job, "abandon_above_s": ABANDON_FACTOR * best_s} if math.isfinite(best_s) else job


class Tuner:
    def __init__(self, task: TuningTask, space: list[MicroKernel], cores: int, runner, database: RecordDatabase,
                 options: TuneOptions = DEFAULT_OPTIONS, log: Callable[[str], None] = lambda _m: None,
                 progress_stream=None, hardware: CpuHardware | GpuHardware | None = None):
        self.task = task
        self.runner = runner
        self.database = database
        self.options = options
        self.log = log
        self.progress_stream = progress_stream
        self.cores = cores
        self.model = CostModel(cores, options.seed)
        self.space = task_space(space, task.spec.func, hardware)  # (``hardware``: the L2 a task block must fit)
        # Each packing's tallest register tile (the committed packing's space drops the others):
        # how many rows a plan in that packing could cover in one pass over the weight.
        self.tallest_tiles: dict[int, int] = {}
        for kernel in self.space:
            if kernel.pack > 0:
                self.tallest_tiles[kernel.pack] = max(self.tallest_tiles.get(kernel.pack, 0), kernel.tile_sizes("i")[0])
        self.search = EvolutionarySearch(self.space, seed=options.seed)
        self.packing: int | None = None  # the committed panel width (``commit_packing``); None: any
        self.race_summary = RaceSummary()  # the packing's race and the finalists' (``race.py``)
        self.rng = random.Random(options.seed)
        self.shapes = task.shapes()
        self.weights = list(task.weights)
        self.measured: dict[tuple, dict[MicroKernel, float]] = defaultdict(dict)  # shape -> kernel -> latency
        self.default_measured: dict[tuple, float] = {}  # shape -> the default rule's kernel's latency
        self.failed: set[MicroKernel] = set()
        self.trials = 0
        self.failures = 0
        self.reused = 0
        self.retimed = 0  # trials timed again, beside other work the first time (``_run_job``)
        self.check_shape = task.check_shape()
        # Only the CPU worker streams weights (``measure/streaming.py``): a CUDA job ignores it.
        self.streams_weights = bool(getattr(runner, "streams_weights", False)) and task.target.get("kind") == "llvm"
        # The smallest shape: a regime of its own (weight streaming, no row reuse).
        self.smallest = min(range(len(self.shapes)), key=lambda i: task.dispatch_value(self.shapes[i]))
        self._calibrated_cache: dict[MicroKernel, float] | None = None  # reset by each measurement
        # shape key -> kernel -> factor on the served-latency model there (``race.py``'s streamed races)
        self.corrections: dict[tuple, dict[MicroKernel | None, float]] = {}
        self.commitment = PlanCommitment(self)
        # Each shape's candidates timed beside a reference kernel, on its scale (``reference_scale``):
        # CPU kernels timed hot on this machine (the worker ignores it elsewhere).
        self.scale = ReferenceScale() if options.reference_timing and task.target.get("kind") == "llvm" \
            and not self.streams_weights else None
        self._reuse_records()

    def _reuse_records(self) -> None:
        """Measurements already in the database for this workload and target, on our shapes,
        made by this version of the tuner (an older one measured differently) with the weights
        where ours are (cached, or streamed from DRAM: ``MeasureOptions.stream_weights``)."""
        ours = {shape_key(shape) for shape in self.shapes}
        for record in self.database.records():
            if record.workload != self.task.workload or record.target != self.task.target_key \
                    or record.meta.get("tuner") != TUNER_VERSION \
                    or record.meta.get("streamed", False) != self.streams_weights:
                continue
            key = record.shape_key()
            if record.kernel == DEFAULT_VARIANT:
                if record.ok and key in ours:
                    self.default_measured[key] = min(record.latency_s, self.default_measured.get(key, float("inf")))
                continue
            kernel = MicroKernel.from_json(record.kernel)
            if not record.ok:
                self.failed.add(kernel)
            elif key in ours and kernel not in self.measured[key]:
                self.measured[key][kernel] = record.latency_s
                self.model.add(kernel, self.task.axis_extents(dict(key)), self.task.flops(dict(key)), record.latency_s)
                self.reused += 1
        self.model.fit()

    # -- priorities ------------------------------------------------------------------------
    def _searchable(self, kernel: MicroKernel) -> bool:
        """A kernel the search still works for: of the committed packing, once there is one."""
        return self.packing is None or kernel.pack == self.packing

    def _measured_here(self, shape: dict) -> list[float]:
        return [t for k, t in self.measured.get(shape_key(shape), {}).items() if self._searchable(k)]

    def _best_latency(self, shape: dict) -> float:
        measured = self._measured_here(shape)
        if measured:
            return min(measured)
        return self._predicted_best(shape)

    def _predicted_best(self, shape: dict) -> float:
        known = {k: t for k, t in self.calibrated().items() if self._searchable(k)}
        if not known:
            return float("inf")
        extents = self.task.axis_extents(shape)
        flops = self.task.flops(shape)
        return min(flops / (thr * adapt(extents, kernel, self.cores)) for kernel, thr in known.items())

    def _weighted(self) -> list[tuple[dict, float]]:
        return list(zip(self.shapes, self.weights, strict=True))

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
        measured = self.measured.get(shape_key(shape), {}).get(kernel)
        if measured is not None:
            return measured
        throughput = self.calibrated().get(kernel)
        if throughput is None:
            return float("inf")
        return self.task.flops(shape) / (throughput * adapt(self.task.axis_extents(shape), kernel, self.cores))

    def _job(self, shape: dict, job: dict) -> dict:
        return {"recipe": self.task.spec.recipe, "target": self.task.target, "shapes": [shape],
                "check_shape": self.check_shape, **job}

    def _kernel_job(self, kernel: MicroKernel) -> dict:
        return {"kernel": kernel.to_json(), "apply": self.options.apply, "loop_partition": self.options.loop_partition}

    def prepare(self, probes: list[tuple[MicroKernel, dict]]) -> None:
        """Have the runner build the kernels of ``probes`` ahead, in parallel where it can
        (``LocalRunner.prepare``): as many as the trials left will time."""
        prepare = getattr(self.runner, "prepare", None)
        if prepare is None:
            return
        left = self.options.trials - self.trials
        probes = [(kernel, shape) for kernel, shape in probes
                  if kernel not in self.failed and kernel not in self.measured.get(shape_key(shape), {})]
        prepare([self._job(shape, self._kernel_job(kernel)) for kernel, shape in probes[:left]])

    def _run_job(self, kernel: MicroKernel | None, shape: dict, job: dict) -> float | None:
        """Run one measurement job and record it (append-only); returns the latency to keep, on
        the shape's reference scale where there is one (``_timed``), or None. A
        timing during which other work took more than ``CONTENDED_SHARE`` of the CPUs is done
        once more (not another trial), and the quieter of the two is kept: a neighbour on one
        core slows a kernel on every core and not a serial one."""
        reference = None if self.scale is None else self.scale.reference(shape_key(shape))
        if reference is not None and reference != kernel:
            job = {**job, "reference": self._kernel_job(reference)}
        result = self.runner.run(self._job(shape, job))
        busy = result.get("others_share")
        if result.get("error") is None and busy is not None and busy > CONTENDED_SHARE:
            again = self.runner.run(self._job(shape, job))
            self.retimed += 1
            if again.get("error") is None and (again.get("others_share") or 0.0) < busy:
                result = again
        self.trials += 1
        error = result.get("error")
        latency = None if error is not None else next(iter(result["latencies"].values()))
        beside = next(iter((result.get("references") or {}).values()), None)
        if error is not None:
            self.failures += 1
            self.log(f"{kernel or 'the default kernel'} failed on {shape}: {error}")
        self.database.append(TuningRecord(
            workload=self.task.workload, target=self.task.target_key,
            kernel=DEFAULT_VARIANT if kernel is None else kernel.to_json(), shape=shape, latency_s=latency, error=error,
            meta={"tuner": TUNER_VERSION, "runner": self.runner.describe(), "streamed": self.streams_weights,
                  "time": time.time(), "others_share": result.get("others_share"),
                  "flops": self.task.flops(shape), "build_s": result.get("build_seconds"),
                  "build_reused": result.get("build_reused", False),
                  "check_shape": self.check_shape,
                  **({"reference": reference.to_json(), "reference_s": beside["seconds"],
                      "reference_ratio": beside["ratio"]} if beside is not None else {})},
        ))
        return None if latency is None else self._timed(kernel, shape, latency, beside, job)

    def _timed(self, kernel: MicroKernel | None, shape: dict, latency: float, beside: dict | None, job: dict) -> float:
        """``kernel``'s measurement on ``shape`` to keep: ``latency`` as timed, or on the shape's
        reference scale (``ReferenceScale``), which may move the shape's other measurements."""
        if self.scale is None:
            return latency
        key = shape_key(shape)
        hopeless = latency > job.get("abandon_above_s", math.inf)
        here = dict(self.measured.get(key, {}))
        if key in self.default_measured:
            here[None] = self.default_measured[key]
        kept = self.scale.timed(key, kernel, latency, beside, here, hopeless)
        for other, value in kept.items():
            if other != kernel:
                self.set_measured(other, key, value, rescaled=True)
        return kept[kernel]

    def measure_default(self, shape: dict) -> None:
        """The untuned build's kernel on ``shape``: the bar every variant must clear there. Where
        it runs ``ABANDON_FACTOR`` times as long as the best kernel measured there (or, before
        any, predicted), one call is its time: no plan takes it there, and on bert-base's 3072 ->
        768 layer at T near 512 its warm-up, probe and repeats took 0.2-1.5 s a shape (ad hoc)."""
        latency = self._run_job(None, shape, _abandoning({"kernel": None}, self._best_latency(shape)))
        if latency is not None:
            self.default_measured[shape_key(shape)] = latency

    def by_cost(self) -> list[tuple[dict, float]]:
        """(shape, weight) of the shapes the traffic has, the costliest (weight x FLOPs) first:
        where the commitment probes and races (``commitment.width_probes``, ``race.race_packings``)."""
        pairs = enumerate(zip(self.shapes, self.weights, strict=True))
        costs = sorted(((w * self.task.flops(s), i) for i, (s, w) in pairs if w > 0), reverse=True)
        return [(self.shapes[i], self.weights[i]) for _cost, i in costs]

    def measured_latency(self, kernel: MicroKernel | None, key: tuple) -> float:
        """``kernel``'s measurement on the shape ``key`` (None: the default kernel's)."""
        return self.default_measured[key] if kernel is None else self.measured[key][kernel]

    def set_measured(self, kernel: MicroKernel | None, key: tuple, latency: float, rescaled: bool = False) -> None:
        """Replace a measurement (``race.py``: timed again beside its rivals; ``rescaled``: the
        shape's reference level moved); the cost model keeps the search's."""
        if self.scale is not None and not rescaled:
            self.scale.replaced(key, kernel, latency)
        if kernel is None:
            self.default_measured[key] = latency
        else:
            self.measured[key][kernel] = latency
            self._calibrated_cache = None

    def measure(self, kernel: MicroKernel, shape: dict) -> None:
        best = self.measured.get(shape_key(shape))
        job = _abandoning(self._kernel_job(kernel), min(best.values()) if best else math.inf)
        latency = self._run_job(kernel, shape, job)
        if latency is None:
            self.failed.add(kernel)
            return
        self.measured[shape_key(shape)][kernel] = latency
        self._calibrated_cache = None
        self.model.add(kernel, self.task.axis_extents(shape), self.task.flops(shape), latency)

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> TuneResult:
        """Search over every packing, commit one, search in it, then verify the plan's choices
        (a quarter of the budget is kept for it, half of that for the final plan); the trials
        verification did not need are searched last."""
        started = time.monotonic()
        bar = ProgressBar(self.options.trials, self.task.workload, stream=self.progress_stream)
        budget = self.options.trials
        final_check = budget // 8  # kept to verify the plan the second search leads to
        self._search(int(budget * PACKING_SHARE), started, bar)
        self.commit_packing(until=budget - budget // 4)
        self._search(budget - budget // 4, started, bar)
        self.commitment.verify(budget - final_check, bar)
        self._search(budget - final_check, started, bar)
        self.commitment.verify(budget, bar)
        self._search(budget, started, bar)  # the trials the final verification did not need
        budget_s = self.options.time_budget_s
        deadline = None if budget_s is None else started + budget_s
        races = race_finalists(self, bar, deadline, self.race_summary)
        races = race_unmeasured_intervals(self, bar, deadline, races)
        bar.close(self.trials, self.status())
        plan = self.plan({"tuning_seconds": round(time.monotonic() - started, 3), "runner": self.runner.describe(),
                          **races.describe()})
        return TuneResult(plan, self.trials, self.failures, time.monotonic() - started)

    def commit_packing(self, until: int) -> None:
        """Search only the packing the plan would take now (``PlanCommitment.choose_packing``,
        by ``until`` trials), unless it lost the packings' race (``race.race_packings``):
        kernels of other packings measured so far stay in the cost model's data, and the
        committed packing's single-pass tiles and each of its register-tile widths are measured
        at once (a space of one packing: its own; an unpacked space of clamped tiles, each
        column-tile width: ``PlanCommitment.width_probes``)."""
        widths = {k.pack for k in self.space}
        if len(widths) < 2:
            packing = next(iter(widths), 0)
        else:
            packing = race_packings(self, widths, self.commitment.choose_packing(widths, until), self.race_summary)
            if packing is None:
                return
            self.packing = packing
            self.space = [k for k in self.space if k.pack == packing]
            self.search = EvolutionarySearch(self.space, seed=self.options.seed + 1)
            self.log(f"{self.task.workload}: packing committed to {packing}-wide panels after {self.trials} trials"
                     f" ({len(self.space)} kernels read it)")
        self.commitment.measure_single_pass(packing, until)
        self.commitment.measure_every_width(until)

    def _search(self, until: int, started: float, bar: ProgressBar) -> None:
        while self.trials < until:
            if self.options.time_budget_s is not None and time.monotonic() - started >= self.options.time_budget_s:
                self.log(f"time budget of {self.options.time_budget_s:.0f} s reached after {self.trials} trials")
                return
            shapes = choose_shapes(self)
            per_shape = max(1, self.options.candidates_per_round // len(shapes))
            for shape in shapes:
                extents, flops = self.task.axis_extents(shape), self.task.flops(shape)
                # The default kernel is timed after the candidates, against the best of them
                # (``measure_default``), but its trial is kept for it from the start.
                default = 1 if shape_key(shape) not in self.default_measured and self.trials < until else 0

                def score(kernels, extents=extents, flops=flops):
                    return -self.model.predict_latency(kernels, extents, flops)

                exclude = set(self.measured.get(shape_key(shape), {})) | self.failed
                seeds = sorted(filter(self._searchable, self.calibrated()),
                               key=lambda k, shape=shape: self.estimate(k, shape))[:16]
                proposed = self.search.propose(score, per_shape, exclude, seeds)[:max(0, until - self.trials - default)]
                self.prepare([(kernel, shape) for kernel in proposed])
                for kernel in proposed:
                    if self.trials >= until - default:
                        break
                    self.measure(kernel, shape)
                    bar.update(self.trials, self.status())
                if default:
                    self.measure_default(shape)
            self.model.fit()

    def status(self) -> str:
        measured = sum(1 for v in self.measured.values() if v)
        return f"| {measured} shapes measured | {self.failures} failed"

    def plan(self, provenance: dict | None = None) -> KernelPlan:
        """The best plan over the measurements so far (``planning.make_plan``), with this tune's
        provenance and ``provenance``'s."""
        return make_plan(self, {"tuner": TUNER_VERSION, "trials": self.trials, "reused_records": self.reused,
                                "failures": self.failures, "retimed": self.retimed,
                                **(self.options.dram.describe() if self.options.dram else {}), **(provenance or {})})
