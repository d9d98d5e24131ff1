"""Verify: plan, measure each interval's variant (beside the default kernel) at the interval's
ends and middle where it was only predicted, plan again, at most ``VERIFY_ROUNDS`` times. Between
measured shapes a plan relies on predictions, which a small budget can get badly wrong. First the
small-T regime, the single-pass tiles, and the whole-reduction twins of blocked tiles the plan
runs where the weight's stream bounds them (timed hot the twins tie)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from dietserve.kernels.cpu_packed.kernel import reduces_in_blocks, with_whole_reduction
from dietserve.kernels.plan.microkernel import MicroKernel

from . import BatchPhase, Probe, by_prediction
from .commit import single_pass_probes

if TYPE_CHECKING:
    from ..tune import Tuner

VERIFY_ROUNDS = 3  # plan -> measure its unverified choices -> plan again, at most this often
# One-row kernels measured on the smallest shape, every threading among them.
SMALL_REGIME_KERNELS = 3
# Shapes a kernel passes over in at most this many row passes: its first pass, which streams the
# weight from DRAM, is at least half its FMAs, and how it streams shows.
STREAM_BOUND_PASSES = 2


class Verify(BatchPhase):
    def batches(self, tuner: Tuner, until: int) -> Iterator[list[Probe]]:
        for _round in range(VERIFY_ROUNDS):
            try:
                plan = tuner.plan()
            except RuntimeError:  # nothing measured successfully: nothing to verify
                return
            probes = small_regime_probes(tuner, plan.pack) + single_pass_probes(tuner, plan.pack) \
                + whole_reduction_probes(tuner, plan) + unverified_probes(tuner, plan)
            if not probes:
                return
            # Each beside the default kernel on its shape, measured first.
            yield [p for probe in probes for p in (Probe(None, probe.shape), probe)]

    def observe(self, tuner: Tuner, results: list[tuple[Probe, float | None]]) -> None:
        """(No refit: the next exploration fits on everything measured.)"""


def unverified_probes(tuner: Tuner, plan) -> list[Probe]:
    """Each micro-kernel interval's variant at its first, middle and last shape, where it or the
    default kernel was not measured yet."""
    rows, probes, start = plan.shapes, [], 0
    for end in range(1, len(rows) + 1):
        if end < len(rows) and rows[end]["variant"] == rows[start]["variant"]:
            continue
        kernel = plan.kernel(rows[start]["variant"])
        for index in sorted({start, (start + end - 1) // 2, end - 1}) if kernel is not None else ():
            shape = rows[index]["shape"]
            if not (tuner.store.has(kernel, shape) and tuner.store.has(None, shape)):
                probes.append(Probe(kernel, shape))
        start = end
    return probes


def small_regime_probes(tuner: Tuner, pack: int) -> list[Probe]:
    """One-row kernels of the plan's packing on the smallest shape, until ``SMALL_REGIME_KERNELS``
    are measured there with each threading among them (the missing threadings first). An
    unpacked space gets each missing threading, any tile (kernels on every core are floored by
    their own best there: ``estimates``)."""
    smallest = tuner.shapes[tuner.smallest]
    measured = tuner.store.on(smallest)
    if pack:
        kernels = [k for k in tuner.space if k.pack == pack and k.tile_sizes("i")[0] == 1]
    else:
        kernels = [k for k in tuner.space if not k.pack]
    kernels = [k for k in kernels if k not in tuner.store.failed]
    done = [k for k in kernels if k in measured]
    candidates = [k for k in kernels if not tuner.store.has(k, smallest)]
    if not candidates:
        return []
    ranked = by_prediction(tuner, candidates, smallest)
    probes = [next(k for k in ranked if k.threads == threads)
              for threads in sorted({k.threads for k in ranked} - {k.threads for k in done})]
    if pack:  # (the one-row regime: the cost model's next best too)
        probes += [k for k in ranked if k not in probes][:max(0, SMALL_REGIME_KERNELS - len(done) - len(probes))]
    return [Probe(kernel, smallest) for kernel in probes]


def whole_reduction_probes(tuner: Tuner, plan) -> list[Probe]:
    """Where ``plan`` (ranked as served) runs a blocked-reduction tile on shapes of at most
    ``STREAM_BOUND_PASSES`` row passes, its whole-reduction twin at the middle such shape."""
    if tuner.options.dram is None:
        return []
    runs: dict[MicroKernel, list[dict]] = {}
    for row in plan.shapes:
        kernel = plan.kernel(row["variant"])
        extents = tuner.task.axis_extents(row["shape"])
        if reduces_in_blocks(kernel, extents["k"]) and extents["i"] <= STREAM_BOUND_PASSES * kernel.tile_sizes("i")[0]:
            runs.setdefault(kernel, []).append(row["shape"])
    probes = []
    for kernel, shapes in runs.items():
        twin, shape = with_whole_reduction(kernel), shapes[len(shapes) // 2]
        if twin in tuner.space and not tuner.store.has(twin, shape):
            probes.append(Probe(twin, shape))
    return probes
