"""The latency a plan assumes for a variant on a shape (``layouts.plan_layouts`` chooses with
it): its measurement there, else its throughput carried over from the nearest shape it was
measured on by f_adapt, within the floors measured on the smallest shapes."""

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
    throughput at the nearest shape (by log of the dispatch value) where it was measured, carried
    over by f_adapt (padding waste and core occupancy), times the shape's FLOPs; inf where it was
    never measured. The learned cost model only steers the search: far from the measured shapes
    its predictions can be badly wrong.

    No estimate goes below ``FLOOR_MARGIN`` times the best latency measured on the smallest
    measured shape (carried at constant GFLOP/s a kernel would beat one pass over the weight,
    which every kernel makes), nor runs faster than any kernel was measured to run.

    ``measured``: shape key -> {kernel: latency}; ``default_measured``: shape key -> latency.
    Estimates are memoised: a plan asks for each several times, and the measurements it reads do
    not change while it is made."""
    carried = _Carried(task, measured, default_measured, cores)
    known: dict[tuple, float] = {}

    def remembered(kernel: Variant, shape: dict) -> float:
        key = (kernel, shape_key(shape))
        if key not in known:
            known[key] = carried.estimate(kernel, shape)
        return known[key]

    return remembered


class _Carried:
    def __init__(self, task, measured: dict, default_measured: dict, cores: int) -> None:
        self.task, self.measured, self.default, self.cores = task, measured, default_measured, cores
        points: dict[Variant, list[tuple[float, float]]] = defaultdict(list)
        for key, kernels in measured.items():
            for kernel, latency in kernels.items():
                points[kernel].append(self._point(kernel, key, latency))
        for key, latency in default_measured.items():
            points[None].append(self._point(None, key, latency))
        self.tables = {kernel: np.asarray(sorted(values)) for kernel, values in points.items()}
        self.floor_value, self.floor = _smallest_measured_floor(task, measured, default_measured)
        # A CPU kernel on every core wakes the thread pool however little it computes, which a
        # serial kernel on the smallest shape does not pay: kernels on every core get a floor of
        # their own, the best of theirs on the smallest shape one of them was measured on.
        self.parallel_value, self.parallel_floor = math.inf, 0.0
        if task.target.get("kind") == "llvm":
            on_every_core = {key: {k: t for k, t in kernels.items() if k.threads != 1}
                             for key, kernels in measured.items()}
            self.parallel_value, self.parallel_floor = _smallest_measured_floor(task, on_every_core, {})
        timed = [(key, t) for key, kernels in measured.items() for t in kernels.values()]
        self.fastest = max((task.flops(dict(key)) / t for key, t in timed + list(default_measured.items())),
                           default=0.0)

    def _factor(self, kernel: Variant, shape: dict) -> float:
        from ..cost_model.model import adapt

        return 1.0 if kernel is None else adapt(self.task.axis_extents(shape), kernel, self.cores)

    def _point(self, kernel: Variant, key: tuple, latency: float) -> tuple[float, float]:
        shape = dict(key)
        return math.log(self.task.dispatch_value(shape)), self.task.flops(shape) / latency / self._factor(kernel, shape)

    def estimate(self, kernel: Variant, shape: dict) -> float:
        key = shape_key(shape)
        exact = self.default.get(key) if kernel is None else self.measured.get(key, {}).get(kernel)
        if exact is not None:
            return exact
        table = self.tables.get(kernel)
        if table is None:
            return float("inf")
        value, flops = self.task.dispatch_value(shape), self.task.flops(shape)
        distance = np.abs(table[:, 0] - math.log(value))
        nearest = int(np.argmin(distance))
        carried = max(flops / (table[nearest, 1] * self._factor(kernel, shape)), flops / self.fastest)
        bound = self.floor if value >= self.floor_value else 0.0
        if kernel is not None and kernel.threads != 1 and value >= self.parallel_value:
            bound = max(bound, self.parallel_floor)
        return max(carried, bound * FLOOR_MARGIN) * (1 + CARRY_PENALTY * float(distance[nearest]))


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
