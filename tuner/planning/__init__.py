"""The plan a tune's measurements lead to: each variant's estimated latency on every shape (as
timed, and as served with the weight from DRAM), a few variants and a decision tree over the
dispatch value, written as a ``KernelPlan``. Reads the measurements, changes nothing: the phases
and the final plan all plan through here, so they rank variants alike."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import tvm

from dietserve.kernels.plan.decision_tree import interval_tree
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan
from dietserve.kernels.tir.matching import workload_key

from ..measurements import Measurements, shape_key
from .estimates import nearest_measured_estimates
from .layouts import Estimate, Variant, plan_layouts
from .weight_stream import DramRates, served_estimates

TARGET_KEYS = ("kind", "mcpu", "arch", "num-cores")  # what a plan's target records (the host left out)


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
    """(hot, served): latency estimates of (variant, shape), as timed and as served."""
    estimate = nearest_measured_estimates(store.task, store.kernels, store.default, store.cores)
    return estimate, served_estimates(estimate, store.task, dram)


def make_plan(store: Measurements, packing: int | None, options, tallest: Mapping[int, int],
              provenance: dict) -> KernelPlan:
    """The best plan over ``store``, chosen as served; its rows keep the latencies as timed.
    ``options``: the tune's (variants, intervals, DRAM rates); ``tallest``: each packing's tallest
    tile in the space. Raises RuntimeError where no candidate was measured successfully."""
    task = store.task
    candidates = plan_candidates(store, packing)
    if not candidates:
        raise RuntimeError(f"no candidate of {task.workload} measured successfully; see the records for errors")
    shapes = sorted(task.shapes(), key=task.dispatch_value)
    weight = dict(zip(map(shape_key, task.shapes()), task.weights, strict=True))
    weights = [weight[shape_key(shape)] for shape in shapes]
    estimate, served = ranking(store, options.dram)
    variants, labels = plan_layouts(candidates, shapes, weights, served, store.kernels, store.default,
                                    options.max_variants, options.max_intervals,
                                    rows=[task.axis_extents(shape)["i"] for shape in shapes], tallest=dict(tallest))
    return build_plan(task, variants, labels, shapes, weights, estimate, store, provenance)


def build_plan(task, variants: Sequence[Variant], labels: Sequence[int], shapes: Sequence[dict],
               weights: Sequence[float], estimate: Estimate, store: Measurements, provenance: dict) -> KernelPlan:
    """The plan file's content: the variants used (the default rule's first), the decision tree
    over the dispatch value, one row per shape with its estimate and whether it was measured."""
    used = sorted(set(labels), key=lambda v: (variants[v] is not None, v))
    names = {v: DEFAULT_VARIANT if variants[v] is None else f"v{rank}" for rank, v in enumerate(used)}
    values = [task.dispatch_value(s) for s in shapes]
    rows = [{"shape": shape, "value": value, "variant": names[v], "latency_s": estimate(variants[v], shape),
             "measured": store.latency(variants[v], shape) is not None,
             "default_latency_s": estimate(None, shape), "default_measured": store.latency(None, shape) is not None}
            for shape, value, v in zip(shapes, values, labels, strict=True)]
    return KernelPlan(
        workload=workload_key(task.spec.func), operator=task.spec.name, shape_vars=sorted(task.spec.shape_vars),
        axes=task.axes, target={key: str(value) for key, value in task.target.items() if key in TARGET_KEYS},
        tvm_version=str(tvm.__version__),
        variants={names[v]: (None if variants[v] is None else variants[v].to_dict()) for v in used},
        tree=interval_tree(task.dispatch_var, values, [names[v] for v in labels]),
        tuned_range={"var": task.dispatch_var, "min": min(values), "max": max(values)}, shapes=rows,
        provenance={**provenance, "fixed": dict(task.fixed),
                    "weights": {str(v): w for v, w in zip(values, weights, strict=True) if w != 1.0}},
        precision=task.spec.precision)
