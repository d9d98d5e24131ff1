"""The plan a tune's measurements lead to: the variants it may take, each one's estimated latency
on every shape (as timed, and as served with the weight from DRAM), and the dispatch plan made
from them. Reads the measurements, changes nothing: the phases and the final plan all plan
through here, so they rank variants alike.
"""

from __future__ import annotations

from collections.abc import Mapping

from dietserve.kernels.plan.kernel_plan import KernelPlan
from dietserve.kernels.plan.microkernel import MicroKernel

from ..measurements import Measurements
from .estimates import nearest_measured_estimates
from .layouts import Estimate, Variant, plan_layouts
from .plan_file import build_plan
from .weight_stream import DramRates, served_estimates


def plan_candidates(store: Measurements, packing: int | None) -> list[Variant]:
    """The variants a plan may take: measured kernels (only the committed packing's once there
    is one: its short shapes' tiles are the ones probed) and, where measured, the default kernel."""
    candidates: list[Variant] = [k for k in store.throughputs() if k not in store.failed]
    if packing is not None:
        candidates = [k for k in candidates if k.pack == packing]
    if store.default:
        candidates.append(None)
    return candidates


def ranking(store: Measurements, dram: DramRates | None) -> tuple[Estimate, Estimate]:
    """(hot, served): latency estimates of (variant, shape), as timed (the weight in cache) and as
    served (the weight from DRAM, where the rates are known)."""
    estimate = nearest_measured_estimates(store.task, store.kernels, store.default, store.cores)
    return estimate, served_estimates(estimate, store.task, dram)


def make_plan(store: Measurements, packing: int | None, options, tallest: Mapping[int, int],
              provenance: dict) -> KernelPlan:
    """The best plan over ``store`` (one weight layout per plan, least weighted slowdown), chosen
    as served; its rows keep the latencies as timed. ``options``: the tune's (variants,
    intervals, DRAM rates); ``tallest``: each packing's tallest tile in the space. Raises
    RuntimeError where no candidate was measured successfully."""
    task = store.task
    candidates = plan_candidates(store, packing)
    if not candidates:
        raise RuntimeError(f"no candidate of {task.workload} measured successfully; see the records for errors")
    shapes_all = task.shapes()
    order = sorted(range(len(shapes_all)), key=lambda s: task.dispatch_value(shapes_all[s]))
    shapes = [shapes_all[s] for s in order]
    weights = [task.weights[s] for s in order]
    estimate, served = ranking(store, options.dram)
    variants, labels = plan_layouts(candidates, shapes, weights, served, store.kernels, store.default,
                                    options.max_variants, options.max_intervals,
                                    rows=[task.axis_extents(shape)["i"] for shape in shapes], tallest=dict(tallest))
    return build_plan(task, variants, labels, shapes, weights, estimate, store.kernels, store.default, provenance)


__all__ = ["MicroKernel", "make_plan", "plan_candidates", "ranking"]
