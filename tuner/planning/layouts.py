"""From estimates to a plan's variants: a few micro-kernels per weight layout (a greedy set
cover of the weighted slowdown), the layout with the least, and the intervals of the decision
tree over the ordered shapes (dynamic programming): DietCode's dispatcher. The default rule's
kernel (None) is always a candidate, and the bar a variant must clear where it was measured."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from dietserve.kernels.plan.decision_tree import segment
from dietserve.kernels.plan.microkernel import MicroKernel

from ..measurements import shape_key

Variant = MicroKernel | None  # None: the default rule's kernel
Estimate = Callable[[Variant, dict], float]  # (variant, shape) -> latency seconds
# The smallest shape gets a variant of its own (beyond max_variants) when one measured there is
# this much faster than the variants chosen for the rest: a regime of its own (weight streaming,
# one row) that a weighted set cover would trade away for a fraction of a percent elsewhere.
SMALL_REGIME_GAIN = 1.2
# Shapes of at most this many rows run one pass over the weight in a plan of packed kernels: a
# register tile covering every row. The served model's weights exceed the last-level cache, so a
# dense layer streams its weight from DRAM, and a kernel passing over it again per row tile
# leaves the memory bus idle while it computes; timed hot, the tuner cannot see that. Past this
# height the gain measured from DRAM was gone (docs/design/tuner.md).
SINGLE_PASS_ROWS = 13
# The rule holds where a covering kernel is estimated (weight in cache) at most this much slower
# than the fastest kernel there: about the largest gain a single pass showed from DRAM.
SINGLE_PASS_SLACK = 1.3
# Layouts whose plans' weighted slowdowns are this close are a tie (repeated timings of one kernel
# differ by more). The tie goes to the layout whose tiles cover more short shapes' rows in one
# pass, a gain the weight in cache hides.
LAYOUT_TIE = 0.01


def choose_variants(kernels: Sequence[Variant], shapes: Sequence[dict], weights: Sequence[float],
                    estimate: Estimate, max_variants: int) -> tuple[list[Variant], list[int], list[float]]:
    """Greedy set cover of the weighted total latency: add the kernel that lowers it most,
    up to ``max_variants``. Returns (variants, per-shape variant index, per-shape latency)."""
    table = [[estimate(kernel, shape) for shape in shapes] for kernel in kernels]
    chosen: list[int] = []
    best = [float("inf")] * len(shapes)
    for _round in range(max_variants):
        def total_with(candidate: int, best: list[float] = best) -> float:
            return sum(w * min(b, table[candidate][s]) for s, (w, b) in enumerate(zip(weights, best, strict=True)))

        remaining = [c for c in range(len(kernels)) if c not in chosen]
        if not remaining:
            break
        pick = min(remaining, key=total_with)
        if chosen and total_with(pick) >= sum(w * b for w, b in zip(weights, best, strict=True)) * 0.999:
            break  # another variant would not pay for its code size
        chosen.append(pick)
        best = [min(b, table[pick][s]) for s, b in enumerate(best)]
    assignment = [min(range(len(chosen)), key=lambda v, s=s: table[chosen[v]][s]) for s in range(len(shapes))]
    latency = [table[chosen[v]][s] for s, v in enumerate(assignment)]
    return [kernels[c] for c in chosen], assignment, latency


def covers_in_one_pass(kernel: Variant, rows: int) -> bool:
    """A packed kernel whose register tile holds all ``rows``: it reads the weight once."""
    return kernel is not None and kernel.pack > 0 and kernel.tile_sizes("i")[0] >= rows


def plan_layouts(candidates: Sequence[Variant], shapes: Sequence[dict], weights: Sequence[float],
                 estimate: Estimate, measured: dict, default_measured: dict, max_variants: int,
                 max_intervals: int, rows: Sequence[int] | None = None,
                 tallest: dict[int, int] | None = None) -> tuple[list[Variant], list[int]]:
    """(variants, per-shape variant index) of the best plan. A plan's variants read the weight in
    one layout, so each packing (and the unpacked layout, with the default kernel) is planned on
    its own and the layout with the least weighted slowdown wins: slowdown against the best
    candidate at each shape, not latency, so every request length counts by its weight.

    ``shapes`` come in dispatch order (the first, the smallest, may add a variant:
    ``SMALL_REGIME_GAIN``). ``rows``: each shape's row count, for the single-pass rule in the
    layout chosen, and for the tie between layouts (``LAYOUT_TIE``), broken by ``tallest``: each
    packing's tallest tile in the space. ``measured``/``default_measured``: shape key ->
    {kernel: seconds} / seconds."""
    best = {shape_key(shape): min(estimate(k, shape) for k in candidates) for shape in shapes}

    def slowdown(variant: Variant, shape: dict) -> float:
        return estimate(variant, shape) / best[shape_key(shape)]

    def guarded(variants: list[Variant]) -> np.ndarray:
        return _guarded_cost(variants, shapes, weights, slowdown, measured, default_measured)

    options = [option for layout in sorted({_layout(k) for k in candidates})
               if (option := _layout_option([k for k in candidates if _layout(k) == layout], shapes, weights,
                                            slowdown, estimate, measured, max_variants, max_intervals, guarded))]
    if not options:
        raise RuntimeError("no weight layout has a variant allowed on every shape")
    choice = min(options, key=lambda option: option[0])
    if rows is not None and tallest:  # (the unpacked layout, 0, has no tallest tile: reach 0)
        tied = [option for option in options if option[0] <= choice[0] * (1 + LAYOUT_TIE)]
        choice = max(tied, key=lambda option: (min(SINGLE_PASS_ROWS, tallest.get(_layout(option[3][0]), 0)),
                                               -option[0]))
    _total, variants, labels, group = choice
    if rows is None:
        return variants, labels
    # The single-pass rule only in the layout chosen: it makes a layout whose covering kernels
    # were measured look slower (as timed, weight in cache) than one where none were.
    passes = _single_pass_variants(group, variants, shapes, rows, estimate)
    variants = variants + passes
    cost = guarded(variants)
    _forbid_extra_passes(cost, variants, rows)
    return variants, segment(cost, max_intervals + len(passes))


def _layout_option(group: list[Variant], shapes, weights, slowdown: Estimate, estimate: Estimate, measured: dict,
                   max_variants: int, max_intervals: int, guarded) -> tuple | None:
    """(weighted slowdown, variants, labels, group) of the best plan of one layout's ``group``;
    None where some shape has no variant of it allowed."""
    variants, _, _ = choose_variants(group, shapes, weights, slowdown, max_variants)
    regime = _small_regime_variant(group, variants, shapes[0], estimate, measured)
    if regime is not None:
        variants.append(regime)
    if None in group and None not in variants:
        variants.append(None)  # always a candidate: the guard may need it
    cost = guarded(variants)
    try:
        labels = segment(cost, max_intervals)
    except ValueError:
        return None
    return float(sum(cost[label, column] for column, label in enumerate(labels))), variants, labels, group


def _guarded_cost(variants: list[Variant], shapes, weights, slowdown: Estimate, measured: dict,
                  default_measured: dict) -> np.ndarray:
    """Weighted slowdown per (variant, shape); ``inf`` where a variant was measured slower than
    the untuned kernel and the layout has another variant for the shape. Where it has none the
    guard yields and the layouts' comparison prices the shape (forbidding it would make a whole
    packed layout, which cannot hold the untuned kernel, infeasible)."""
    cost = np.asarray([[w * slowdown(v, s) for s, w in zip(shapes, weights, strict=True)] for v in variants])
    for column, shape in enumerate(shapes):
        untuned = default_measured.get(shape_key(shape))
        slower = [untuned is not None and variant is not None
                  and measured.get(shape_key(shape), {}).get(variant, -math.inf) > untuned for variant in variants]
        if not all(slower):
            cost[[row for row, is_slower in enumerate(slower) if is_slower], column] = np.inf
    return cost


def _small_regime_variant(group: Sequence[Variant], chosen: Sequence[Variant], smallest: dict,
                          estimate: Estimate, measured: dict) -> Variant:
    """The kernel measured fastest at the smallest shape, if it beats every chosen variant there
    by ``SMALL_REGIME_GAIN`` (both as estimated there); else None."""
    timed = measured.get(shape_key(smallest), {})
    here = [k for k in group if k is not None and k in timed and k not in chosen]
    if not here or not chosen:
        return None
    fastest = min(here, key=lambda k: estimate(k, smallest))
    current = min(estimate(v, smallest) for v in chosen)
    return fastest if current > SMALL_REGIME_GAIN * estimate(fastest, smallest) else None


def _single_pass_variants(group: Sequence[Variant], chosen: Sequence[Variant], shapes: Sequence[dict],
                          rows: Sequence[int], estimate: Estimate) -> list[Variant]:
    """For each shape of 2 to ``SINGLE_PASS_ROWS`` rows no chosen variant covers in one pass,
    the group's covering kernel near the fastest there (``_covering_near_fastest``), if any.
    (The chosen variants are of the group: the fastest kernel there is the group's.)"""
    added: list[Variant] = []
    for shape, count in zip(shapes, rows, strict=True):
        if not 1 < count <= SINGLE_PASS_ROWS or any(covers_in_one_pass(v, count) for v in [*chosen, *added]):
            continue
        index = _covering_near_fastest(group, [estimate(k, shape) for k in group], count)
        if index is not None:
            added.append(group[index])
    return added


def _forbid_extra_passes(cost: np.ndarray, variants: Sequence[Variant], rows: Sequence[int]) -> None:
    """``inf`` for a packed variant on a shape of at most ``SINGLE_PASS_ROWS`` rows that it
    would pass over the weight more than once for, where a variant allowed there covers the rows
    near the least cost there (``_covering_near_fastest``; a column's costs are its latencies
    times one factor, so their ratios are the latencies')."""
    for column, count in enumerate(rows):
        if count > SINGLE_PASS_ROWS or _covering_near_fastest(variants, list(cost[:, column]), count) is None:
            continue
        for row, variant in enumerate(variants):
            if variant is not None and variant.pack > 0 and not covers_in_one_pass(variant, count):
                cost[row, column] = np.inf


def _covering_near_fastest(kernels: Sequence[Variant], latencies: Sequence[float], rows: int) -> int | None:
    """The index of the fastest of ``kernels`` covering ``rows`` in one pass (finite latency
    only), if within ``SINGLE_PASS_SLACK`` of the fastest of all; else None."""
    covering = [i for i, k in enumerate(kernels) if covers_in_one_pass(k, rows) and math.isfinite(latencies[i])]
    if not covering:
        return None
    best = min(covering, key=lambda i: latencies[i])
    return best if latencies[best] <= SINGLE_PASS_SLACK * min(latencies) else None


def _layout(variant: Variant) -> int:
    return 0 if variant is None else variant.pack
