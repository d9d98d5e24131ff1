"""The latency a plan assumes for a variant on a shape (``dispatch.plan_layouts`` chooses with it):
its measurement there, else its throughput carried over from the nearest shape it was measured
on by f_adapt, within the floors measured on the smallest shapes."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from ..measurements import shape_key
from .layouts import Estimate, Variant

# The floors of ``nearest_measured_estimates`` are bounds, not measurements: a carried estimate
# stays this much above them, so the kernel measured at the floor's time on the smallest shape
# keeps that shape (a tile carried down to the floor would otherwise tie a one-row kernel there).
FLOOR_MARGIN = 1.25
# A carried estimate is worth less the farther it is carried: priced up by this much per unit of
# |ln| of the ratio between the shape and the one it was carried from, so a kernel measured near
# a shape keeps it from one predicted a little faster from far away.
CARRY_PENALTY = 0.25


def nearest_measured_estimates(task, measured: dict, default_measured: dict, cores: int = 1) -> Estimate:
    """Plans rest on measurements: a variant's latency on a shape is its measured one, else its
    throughput at the nearest shape (by log of the dispatch value) where it was measured,
    carried over by f_adapt (the padding waste and core occupancy of both shapes), times the
    shape's FLOPs; inf where it was never measured. No extrapolation goes below
    ``FLOOR_MARGIN`` times the best latency measured on the smallest measured shape (for shapes
    at or above it): carried over at constant GFLOP/s, a kernel measured on long sequences would
    look faster on short ones than one pass over the weight, which every kernel makes. The
    learned cost model only steers the search: with a small budget its predictions far from the
    measured shapes can be badly wrong (a serial kernel calibrated on short sequences looks fast
    on long ones), and without f_adapt a 6-row tile measured at T=63 would look as fast per FLOP
    at T=1, where 5 of its 6 rows pad.

    ``measured``: shape key -> {kernel: latency}; ``default_measured``: shape key -> latency."""
    from ..cost_model.model import adapt

    def factor(kernel: Variant, shape: dict) -> float:
        return 1.0 if kernel is None else adapt(task.axis_extents(shape), kernel, cores)

    def point(kernel: Variant, key: tuple, latency: float) -> tuple[float, float]:
        shape = dict(key)
        return math.log(task.dispatch_value(shape)), task.flops(shape) / latency / factor(kernel, shape)

    points: dict[Variant, list[tuple[float, float]]] = defaultdict(list)
    for key, kernels in measured.items():
        for kernel, latency in kernels.items():
            points[kernel].append(point(kernel, key, latency))
    for key, latency in default_measured.items():
        points[None].append(point(None, key, latency))
    tables = {kernel: np.asarray(sorted(values)) for kernel, values in points.items()}
    floor_value, floor = _smallest_measured_floor(task, measured, default_measured)
    # A CPU kernel on every core wakes the thread pool however little it computes, which a serial
    # kernel measured on the smallest shape does not pay: kernels on every core get a floor of
    # their own, the best of theirs on the smallest shape one of them was measured on.
    parallel_value, parallel_floor = math.inf, 0.0
    if task.target.get("kind") == "llvm":
        on_every_core = {key: {k: t for k, t in kernels.items() if k.threads != 1} for key, kernels in measured.items()}
        parallel_value, parallel_floor = _smallest_measured_floor(task, on_every_core, {})
    # No carried estimate runs faster than any kernel was measured to run, on any shape: an
    # f_adapt that misjudges one shape must not make a kernel the fastest thing ever seen there.
    timed = [(key, latency) for key, kernels in measured.items() for latency in kernels.values()]
    fastest = max((task.flops(dict(key)) / latency for key, latency in timed + list(default_measured.items())),
                  default=0.0)

    def estimate(kernel: Variant, shape: dict) -> float:
        key = shape_key(shape)
        exact = default_measured.get(key) if kernel is None else measured.get(key, {}).get(kernel)
        if exact is not None:
            return exact
        table = tables.get(kernel)
        if table is None:
            return float("inf")
        value = task.dispatch_value(shape)
        distance = np.abs(table[:, 0] - math.log(value))
        nearest = int(np.argmin(distance))
        carried = max(task.flops(shape) / (table[nearest, 1] * factor(kernel, shape)), task.flops(shape) / fastest)
        bound = floor if value >= floor_value else 0.0
        if kernel is not None and kernel.threads != 1 and value >= parallel_value:
            bound = max(bound, parallel_floor)
        return max(carried, bound * FLOOR_MARGIN) * (1 + CARRY_PENALTY * float(distance[nearest]))

    # A plan asks for each (kernel, shape) several times (the best per shape, each layout's set
    # cover, the guard, the rows); the measurements it reads do not change while it is made.
    known: dict[tuple, float] = {}

    def remembered(kernel: Variant, shape: dict) -> float:
        key = (kernel, shape_key(shape))
        value = known.get(key)
        if value is None:
            value = known[key] = estimate(kernel, shape)
        return value

    return remembered


def _smallest_measured_floor(task, measured: dict, default_measured: dict) -> tuple[float, float]:
    """(dispatch value, best latency) of the smallest shape anything was measured on."""
    latencies: dict[tuple, list[float]] = defaultdict(list)
    for key, kernels in measured.items():
        latencies[key] += list(kernels.values())
    for key, latency in default_measured.items():
        latencies[key].append(latency)
    latencies = {key: values for key, values in latencies.items() if values}
    if not latencies:
        return math.inf, 0.0
    smallest = min(latencies, key=lambda key: task.dispatch_value(dict(key)))
    return task.dispatch_value(dict(smallest)), min(latencies[smallest])
