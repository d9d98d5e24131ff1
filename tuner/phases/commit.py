"""Commit a packing: a plan reads one weight layout, so after the first rounds the search commits
to the panel width the plan would take, measured against every other width on the same shapes.
Then, at once (verification could use up the budget first): the packing's single-pass tiles on
short shapes, and each register-tile width on the costliest shape (an unpacked space, attention's
clamped tiles, commits nothing and probes its column-tile widths)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from dietserve.kernels.cpu_clamped.kernel import is_clamped
from dietserve.kernels.cpu_packed.kernel import packed_tile, reduces_in_blocks
from dietserve.kernels.plan.microkernel import MicroKernel

from ..cost_model.features import register_tile
from ..planning.layouts import SINGLE_PASS_ROWS
from . import BatchPhase, Probe, by_prediction

if TYPE_CHECKING:
    from ..tune import Tuner

# Tile heights probed (or the packing's tallest): every shape of 2 to SINGLE_PASS_ROWS rows then
# has a covering tile measured that pads at most a third of its rows.
SINGLE_PASS_PROBE_ROWS = (2, 4, 7, 10, SINGLE_PASS_ROWS)
SINGLE_PASS_SHARE = 1 / 8  # of the trial budget the commit spends on them, at most
WIDTH_SHARE = 1 / 8  # of the trial budget the commit spends on the register-tile widths, at most


class CommitPacking(BatchPhase):
    def batches(self, tuner: Tuner, until: int) -> Iterator[list[Probe]]:
        widths = {k.pack for k in tuner.space}
        if len(widths) < 2:
            packing = next(iter(widths), 0)
        else:
            yield every_packing_probes(tuner, widths)[:max(0, until - tuner.trials)]
            tuner.model.fit()
            packing = _planned_packing(tuner, widths)
            if packing is None:  # nothing measured yet, or the untuned layout won: keep searching all
                return
            tuner.commit(packing)
        cap = min(until, tuner.trials + int(tuner.options.trials * SINGLE_PASS_SHARE))
        yield single_pass_probes(tuner, packing)[:max(0, cap - tuner.trials)]
        cap = min(until, tuner.trials + int(tuner.options.trials * WIDTH_SHARE))
        yield width_probes(tuner)[:max(0, cap - tuner.trials)]


def _planned_packing(tuner: Tuner, widths: set[int]) -> int | None:
    try:
        packing = tuner.plan().pack
    except RuntimeError:
        return None
    return packing if packing in widths else None


def every_packing_probes(tuner: Tuner, widths: set[int]) -> list[Probe]:
    """On every shape measured so far, the cost model's best kernel of each packing not measured
    there: packings compared on the same shapes, not one against another's extrapolation."""
    probes = []
    for shape in tuner.store.measured_shapes():
        here = tuner.store.on(shape)
        for width in sorted(widths):
            if any(k.pack == width for k in here):
                continue
            candidates = [k for k in tuner.space if k.pack == width and k not in tuner.store.failed]
            if candidates:
                probes.append(Probe(by_prediction(tuner, candidates, shape)[0], shape))
    return probes


def single_pass_probes(tuner: Tuner, pack: int) -> list[Probe]:
    """At each of ``SINGLE_PASS_PROBE_ROWS`` rows, on the shape with that many rows, the cost
    model's best kernel of ``pack`` exactly that tall (on every core where the space has one: a
    single pass is to keep the memory bus busy), unless one is measured there. The plan's
    single-pass rule needs them; a search drawn to where the FLOPs are seldom reaches them."""
    if not pack:
        return []
    tiles = [k for k in tuner.space if k.pack == pack and k not in tuner.store.failed]
    if not tiles:
        return []
    tallest = max(k.tile_sizes("i")[0] for k in tiles)
    probes = []
    for count in sorted({min(rows, tallest) for rows in SINGLE_PASS_PROBE_ROWS}):
        shape = next((s for s in tuner.shapes if tuner.task.axis_extents(s)["i"] == count), None)
        exact = [k for k in tiles if k.tile_sizes("i")[0] == count]
        if shape is None or not exact or any(k in exact for k in tuner.store.on(shape)):
            continue
        exact = [k for k in exact if k.threads != 1] or exact
        probes.append(Probe(by_prediction(tuner, exact, shape)[0], shape))
    return probes


def width_probes(tuner: Tuner) -> list[Probe]:
    """On the costliest shape (weight x FLOPs), for each register-tile width on every core: its
    tallest tile in its plainest layout (the most reuse of each B vector), then the cost model's
    best of the width, unless measured there. The evolution may steer away from a width early;
    measured on the costliest shape, each width's estimate reaches the plan everywhere."""
    kernels = [k for k in tuner.space if (is_clamped(k) or k.pack) and k not in tuner.store.failed]
    by_cost = tuner.by_cost()
    if not kernels or not by_cost:
        return []
    shape = by_cost[0][0]
    depth = tuner.task.axis_extents(shape)["k"]
    measured = [k for k in tuner.store.on(shape) if k in kernels and k.threads != 1]
    tallest, best = [], []
    for width in sorted({_width(k) for k in kernels}):
        of_width = [k for k in kernels if _width(k) == width]
        of_width = [k for k in of_width if k.threads != 1] or of_width
        plain = [k for k in of_width if _plain(k, depth)]
        if plain:
            rows = max(register_tile(k)[0] for k in plain)
            candidates = [k for k in plain if register_tile(k)[0] == rows]
            if not any(k in candidates for k in measured):
                tallest.append(by_prediction(tuner, candidates, shape)[0])
        if not any(_width(k) == width for k in measured):
            best.append(by_prediction(tuner, of_width, shape)[0])
    # The tallest tiles first: the commit's share of the budget may end before the rest.
    return [Probe(kernel, shape) for kernel in dict.fromkeys(tallest + best)]


def _width(kernel: MicroKernel) -> int:
    """The columns of ``kernel``'s register tile."""
    return register_tile(kernel)[1]


def _plain(kernel: MicroKernel, depth: int) -> bool:
    """Packed: one register tile a task, the whole reduction in registers; clamped: any."""
    if not kernel.pack:
        return True
    _mr, _panel, per_tile, per_task = packed_tile(kernel)
    return per_tile == per_task and not reduces_in_blocks(kernel, depth)
