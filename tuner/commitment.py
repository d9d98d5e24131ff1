"""The choices a search's measurements must earn before a plan trusts them (a part of
``tune.Tuner``, whose measurements it reads and whose ``measure``/``plan`` it calls; the
search's own state, the space and the committed packing, stays the tuner's to change):

- **the packing**: a plan reads one weight layout, so after the first rounds the search commits
  to the panel width the plan would take, measured against every other width on the same shapes;
  an unpacked space (attention's clamped tiles) has no packing to commit, and there every
  column-tile width is measured instead, on the shape costing the most time;
- **the plan's picks**: each tuned interval's variant is measured at the interval's ends and
  middle (and the smallest shape's one-row regime in the committed packing, and tiles exactly
  as tall as a few short shapes: the single-pass regime), then the plan is made again, until
  no choice rests on a prediction alone. Where a plan ranked as served (the weight from DRAM)
  sends short shapes to a tile with a blocked reduction, the same tile with the whole
  reduction is measured there too: timed hot the two tie, and only then can the plan weigh the
  blocked one's slower stream (``weight_stream.BLOCKED_STREAM_COST``).
"""

from __future__ import annotations

import numpy as np

from dietserve.kernels.cpu_clamped import is_clamped
from dietserve.kernels.cpu_packed import packed_tile, reduces_in_blocks, with_whole_reduction
from dietserve.kernels.microkernel import MicroKernel

from .cost_model.features import register_tile
from .dispatch import SINGLE_PASS_ROWS, shape_key, unverified_probes
from .progress import ProgressBar

VERIFY_ROUNDS = 3  # plan -> measure its unverified choices -> plan again, at most this often
# One-row kernels of the committed packing measured on the smallest shape, every threading among
# them: a tune that had measured only serial ones there ran bert-base's residual 768x768 layer
# at T = 1 on a 4-row tile, 1.6x slower than a parallel one-row kernel.
SMALL_REGIME_KERNELS = 3
# Row counts where a kernel whose tile is exactly that tall is measured (or the packing's
# tallest, where it holds fewer rows): the plan sends each shape of 2 to SINGLE_PASS_ROWS rows
# to a tile covering it, and with these every shape has one measured that pads at most a third
# of its rows.
SINGLE_PASS_PROBE_ROWS = (2, 4, 7, 10, SINGLE_PASS_ROWS)
SINGLE_PASS_SHARE = 1 / 8  # of the trial budget the commit point spends on them (all 5 at 40 trials)
WIDTH_SHARE = 1 / 8  # of the trial budget the commit point spends on the column widths (all 5 at 40 trials)
# Shapes a kernel passes over in at most this many row passes: its first pass, which streams the
# weight from DRAM, is at least half its FMAs (``weight_stream``), and how it streams shows.
STREAM_BOUND_PASSES = 2


def _width(kernel: MicroKernel) -> int:
    """The columns of ``kernel``'s register tile."""
    return register_tile(kernel)[1]


def _plain(kernel: MicroKernel, depth: int) -> bool:
    """A kernel in its plainest layout (``width_probes``) for a reduction ``depth`` deep: a packed
    one with one register tile a task and the whole reduction in registers; any clamped one (each
    reduces whole, and its task layouts, the rows a task runs and whether it stages B, ran within
    1.11x of each other: ``forced_kernels.py --op attention_context``, 6 x 64 tiles at T = 512,
    1.40-1.55 ms)."""
    if not kernel.pack:
        return True
    _mr, _panel, per_tile, per_task = packed_tile(kernel)
    return per_tile == per_task and not reduces_in_blocks(kernel, depth)


class PlanCommitment:
    """Packing commitment and plan verification for one ``tune.Tuner``."""

    def __init__(self, tuner) -> None:
        self.tuner = tuner

    def choose_packing(self, widths: set[int], until: int) -> int | None:
        """The packing of ``widths`` the plan would take now, after measuring each on the same
        shapes (stopping at ``until`` trials): the space's design, the packing first, then the
        variants that fit it. None where the untuned kernel's layout won everywhere so far, or
        nothing was measured yet."""
        self._measure_every_packing(widths, until)
        try:
            packing = self.tuner.plan().pack
        except RuntimeError:  # nothing measured yet: keep searching every packing
            return None
        return packing if packing in widths else None

    def measure_single_pass(self, pack: int, until: int) -> None:
        """The single-pass tiles of ``pack`` at once, not left to the verification, whose interval
        probes can use up the budget first; at most ``SINGLE_PASS_SHARE`` of the budget (a
        6-trial tune spent half on them, and verified none of its choices)."""
        tuner = self.tuner
        until = min(until, tuner.trials + int(tuner.options.trials * SINGLE_PASS_SHARE))
        probes = self.single_pass_probes(pack)
        tuner.prepare(probes[:max(0, until - tuner.trials)])
        for kernel, shape in probes:
            if tuner.trials < until:
                tuner.measure(kernel, shape)
        tuner.model.fit()

    def measure_every_width(self, until: int) -> None:
        """``width_probes`` at once (stopping at ``until`` trials, and after ``WIDTH_SHARE`` of the
        budget)."""
        tuner = self.tuner
        until = min(until, tuner.trials + int(tuner.options.trials * WIDTH_SHARE))
        probes = self.width_probes()
        tuner.prepare(probes[:max(0, until - tuner.trials)])
        for kernel, shape in probes:
            if tuner.trials < until:
                tuner.measure(kernel, shape)
        tuner.model.fit()

    def width_probes(self) -> list[tuple[MicroKernel, dict]]:
        """On the tuned shape costing the most (weight x FLOPs), the cost model's best kernel of
        each register-tile width (``features.register_tile``: a clamped tile's columns, a packed
        one's ``pk`` panels, of the committed packing) not yet measured there, on every core
        where the space has such a kernel. The evolution follows the cost model, which may steer
        away from a width early: of eleven 64-trial tunes of bert-base's context product, one
        measured no 16-wide tile on every core at T >= 63, the width that ran 1.3-1.45x faster
        than the 8-wide ones it planned at T = 129-512 (``forced_kernels.py --op
        attention_context``); a bert-base benchmark's tune of the 3072 -> 768 layer planned a
        10 x 32 tile at T = 478-512, where a 6 x 64 one (two 32-wide panels) ran 1.21x as fast
        (forced, interleaved: 7.36 against 8.91 ms at T = 512, PyTorch 8.29). Calibrated on the
        longest shape, each width's estimate reaches the plan everywhere, and the verification
        measures it where the plan takes it.

        Each width also gets its tallest tile (the most rows the registers hold: the most reuse of
        each B vector) in its plainest layout (``_plain``), the cost model's pick of those, unless
        one is measured there; these come first. The cost model, given the choice, picked one-row
        tiles (the small-T regime) at T = 512, and a width measured only in blocked or many-tile
        tasks, in a slow spell, lost the plan. A version-44 benchmark tune of the context product
        planned an 11 x 32 tile at T >= 129; forced, 6 x 64 tiles ran 1.40-1.55 ms at T = 512
        against its 1.90 (PyTorch 2.05). A bert-base benchmark's version-42 tune of the 3072 -> 768
        layer timed the 6 x 64 tile at T = 503-512
        only as 6,32,2,1,384, 6,32,2,4,256 and 6,32,2,4,384 (12.2-16.2 ms) and planned 11 x 32
        and 9 x 32 tiles there; forced (``forced_kernels.py``, 5 rounds, 2-core Emerald Rapids),
        the plain 6,32,2,1,1 ran 8.68 ms at T = 512 against 10.05 (11 x 32), 10.78 (6,32,2,4,256)
        and PyTorch's 9.73, and 1.91 at T = 128 against 2.39, 2.51 and 2.59."""
        tuner = self.tuner
        kernels = [k for k in tuner.space if (is_clamped(k) or k.pack) and k not in tuner.failed]
        if not kernels:
            return []
        by_cost = tuner.by_cost()
        if not by_cost:
            return []
        shape = by_cost[0][0]
        depth = tuner.task.axis_extents(shape)["k"]
        measured = [k for k in tuner.measured.get(shape_key(shape), {}) if k in kernels and k.threads != 1]
        tallest, best = [], []
        for width in sorted({_width(k) for k in kernels}):
            of_width = [k for k in kernels if _width(k) == width]
            of_width = [k for k in of_width if k.threads != 1] or of_width
            plain = [k for k in of_width if _plain(k, depth)]
            if plain:
                rows = max(register_tile(k)[0] for k in plain)
                candidates = [k for k in plain if register_tile(k)[0] == rows]
                if not any(k in candidates for k in measured):
                    tallest.append(self.by_prediction(candidates, shape)[0])
            if not any(_width(k) == width for k in measured):
                best.append(self.by_prediction(of_width, shape)[0])
        # The tallest tiles first: the commit point's share of the budget may end before the rest.
        return [(kernel, shape) for kernel in dict.fromkeys(tallest + best)]

    def _measure_every_packing(self, widths: set[int], until: int) -> None:
        """On every shape measured so far, the kernel the cost model likes best of each packing
        not yet measured there: the choice compares packings on the same shapes, not one
        measured against another's extrapolation (the evolution may have favoured one)."""
        tuner = self.tuner
        probes = []
        for key in [key for key, kernels in tuner.measured.items() if kernels]:
            shape = dict(key)
            for width in sorted(widths):
                if any(k.pack == width for k in tuner.measured[key]):
                    continue
                candidates = [k for k in tuner.space if k.pack == width and k not in tuner.failed]
                if candidates:
                    probes.append((self.by_prediction(candidates, shape)[0], shape))
        probes = probes[:max(0, until - tuner.trials)]
        tuner.prepare(probes)
        for kernel, shape in probes:
            tuner.measure(kernel, shape)
        tuner.model.fit()

    def verify(self, budget: int, bar: ProgressBar | None = None) -> None:
        """Measure each tuned interval's variant beside the default kernel at the interval's ends
        and middle, then plan again, until every interval's choice rests on measurements there.

        Between measured shapes a plan relies on predictions (f_microkernel x f_adapt), which a
        small budget can get badly wrong (a serial kernel calibrated on short sequences looks fast
        on long ones); a shape measured slower than the default kernel forbids that variant there.
        Stops when ``budget`` trials have been made."""
        tuner = self.tuner
        for _round in range(VERIFY_ROUNDS):
            try:
                plan = tuner.plan()
            except RuntimeError:  # nothing measured successfully: nothing to verify
                return
            # The small-T regime first: the interval probes can use up the budget.
            probes = self.small_regime_probes(plan.pack) + self.single_pass_probes(plan.pack) \
                + self.whole_reduction_probes(plan) \
                + unverified_probes(plan, tuner.measured, tuner.failed, tuner.default_measured)
            if not probes:
                return
            defaults = len({shape_key(shape) for _, shape in probes} - set(tuner.default_measured))
            tuner.prepare(probes[:max(0, budget - tuner.trials - defaults)])
            for kernel, shape in probes:
                if tuner.trials < budget and shape_key(shape) not in tuner.default_measured:
                    tuner.measure_default(shape)
                if tuner.trials < budget and kernel not in tuner.measured.get(shape_key(shape), {}) \
                        and kernel not in tuner.failed:
                    tuner.measure(kernel, shape)
                if bar is not None:
                    bar.update(tuner.trials, tuner.status())
                if tuner.trials >= budget:
                    return

    def small_regime_probes(self, pack: int) -> list[tuple[MicroKernel, dict]]:
        """One-row kernels of the plan's packing for the smallest shape, until
        ``SMALL_REGIME_KERNELS`` are measured there and each threading (every core, serial) is
        among them: the search may have met the small-T regime (weight streaming) only in the
        other panel width or one threading, and a plan can use one packing only; otherwise the
        smallest shapes go to tiles sized for long sequences, padded row by row. The threadings
        missing come first, then the cost model's next best.

        An unpacked space (attention) gets each threading missing on the smallest shape, any
        tile: the plan floors the estimates of kernels on every core by the best of theirs
        measured on the smallest shape (``estimates.nearest_measured_estimates``), and where
        only serial ones were measured there, a parallel kernel carried down from longer
        sequences looked as fast as them."""
        tuner = self.tuner
        smallest = tuner.shapes[tuner.smallest]
        measured = tuner.measured.get(shape_key(smallest), {})
        if pack:
            kernels = [k for k in tuner.space if k.pack == pack and k.tile_sizes("i")[0] == 1 and k not in tuner.failed]
        else:
            kernels = [k for k in tuner.space if not k.pack and k not in tuner.failed]
        done = [k for k in kernels if k in measured]
        candidates = [k for k in kernels if k not in measured]
        if not candidates:
            return []
        ranked = self.by_prediction(candidates, smallest)
        probes = []
        for threads in sorted({k.threads for k in ranked} - {k.threads for k in done}):
            probes.append(next(k for k in ranked if k.threads == threads))
        if pack:  # (the one-row regime: the cost model's next best too)
            for kernel in ranked:
                if len(done) + len(probes) >= SMALL_REGIME_KERNELS:
                    break
                if kernel not in probes:
                    probes.append(kernel)
        return [(kernel, smallest) for kernel in probes]

    def single_pass_probes(self, pack: int) -> list[tuple[MicroKernel, dict]]:
        """At each of ``SINGLE_PASS_PROBE_ROWS`` rows (or the packing's tallest tile, where it is
        shorter), on the tuned shape with that many rows, the cost model's best kernel of the
        plan's packing whose tile has exactly as many rows, unless one is measured there: the
        plan's single-pass rule (``dispatch.SINGLE_PASS_ROWS``) needs covering kernels measured
        on short shapes, which a search drawn to where the FLOPs are seldom reaches."""
        if not pack:
            return []
        tuner = self.tuner
        tiles = [k for k in tuner.space if k.pack == pack and k not in tuner.failed]
        if not tiles:
            return []
        tallest = max(k.tile_sizes("i")[0] for k in tiles)
        probes = []
        for count in sorted({min(rows, tallest) for rows in SINGLE_PASS_PROBE_ROWS}):
            shape = next((s for s in tuner.shapes if tuner.task.axis_extents(s)["i"] == count), None)
            exact = [k for k in tiles if k.tile_sizes("i")[0] == count]
            if shape is None or not exact or any(k in exact for k in tuner.measured.get(shape_key(shape), {})):
                continue
            # A single pass is to keep the memory bus busy: a tile on every core, where the
            # space has one (one core's tiles measured alone ran 2x slower, and the plan's rule
            # then had only them: ``dispatch.SINGLE_PASS_SLACK``).
            exact = [k for k in exact if k.threads != 1] or exact
            probes.append((self.by_prediction(exact, shape)[0], shape))
        return probes

    def whole_reduction_probes(self, plan) -> list[tuple[MicroKernel, dict]]:
        """Where ``plan`` (ranked as served: the tuner has DRAM rates) runs a blocked-reduction
        tile on a shape it passes over in at most ``STREAM_BOUND_PASSES`` row passes, the same
        tile with the whole reduction at the middle such shape of the interval, unless measured
        there. Forced twins from DRAM ran 1.04-1.38x faster whole at one pass, about 1.1x at two,
        and tied hot: a search drawn by hot timings measures the blocked one only."""
        tuner = self.tuner
        if tuner.options.dram is None:
            return []
        runs: dict[MicroKernel, list[dict]] = {}
        for row in plan.shapes:
            kernel = plan.kernel(row["variant"])
            extents = tuner.task.axis_extents(row["shape"])
            if reduces_in_blocks(kernel, extents["k"]) \
                    and extents["i"] <= STREAM_BOUND_PASSES * kernel.tile_sizes("i")[0]:
                runs.setdefault(kernel, []).append(row["shape"])
        probes = []
        for kernel, shapes in runs.items():
            twin = with_whole_reduction(kernel)
            shape = shapes[len(shapes) // 2]
            if twin in tuner.space and twin not in tuner.failed \
                    and twin not in tuner.measured.get(shape_key(shape), {}):
                probes.append((twin, shape))
        return probes

    def by_prediction(self, candidates: list[MicroKernel], shape: dict) -> list[MicroKernel]:
        """``candidates``, the one the cost model expects to run ``shape`` fastest first."""
        task = self.tuner.task
        predicted = self.tuner.model.predict_latency(candidates, task.axis_extents(shape), task.flops(shape))
        return [candidates[i] for i in np.argsort(predicted, kind="stable")]
