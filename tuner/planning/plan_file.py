"""A plan's file content from its variants and labels (``dietserve.kernels.plan.kernel_plan.KernelPlan``):
the decision tree over the dispatch value and one row per shape with its estimate; and the
probes that would verify a plan's choices where they rest on predictions."""

from __future__ import annotations

from collections.abc import Sequence

import tvm

from dietserve.kernels.plan.decision_tree import interval_tree
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.tir.matching import workload_key

from ..measurements import shape_key
from .layouts import Estimate, Variant


def plan_intervals(plan) -> list[tuple[int, int]]:
    """(start, end) row ranges of ``plan``'s shapes, each a run of one variant."""
    rows, runs, start = plan.shapes, [], 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or rows[end]["variant"] != rows[start]["variant"]:
            runs.append((start, end))
            start = end
    return runs


def unverified_probes(plan, measured: dict, failed: set, default_measured: dict) -> list[tuple[MicroKernel, dict]]:
    """(kernel, shape) at the first, middle and last shape of each micro-kernel's interval of
    ``plan`` where that kernel or the default kernel has not been measured yet."""
    rows = plan.shapes
    probes = []
    for start, end in plan_intervals(plan):
        kernel = plan.kernel(rows[start]["variant"])
        if kernel is not None:
            for index in sorted({start, (start + end - 1) // 2, end - 1}):
                shape = rows[index]["shape"]
                key = shape_key(shape)
                done = kernel in measured.get(key, {}) or kernel in failed
                if not (done and key in default_measured):
                    probes.append((kernel, shape))
    return probes


def plan_target(target: dict) -> dict:
    """The target as manifests describe it (strings; the host left out)."""
    return {key: str(value) for key, value in target.items() if key in ("kind", "mcpu", "arch", "num-cores")}


def build_plan(task, variants: Sequence[Variant], labels: Sequence[int], shapes: Sequence[dict],
               weights: Sequence[float], estimate: Estimate, measured: dict, default_measured: dict,
               provenance: dict) -> KernelPlan:
    """The plan file's content: the variants used (the default rule's first), the decision tree
    over the dispatch value, one row per shape with its estimate and whether it was measured."""
    used = sorted(set(labels), key=lambda v: (variants[v] is not None, v))
    names = {v: DEFAULT_VARIANT if variants[v] is None else f"v{rank}" for rank, v in enumerate(used)}
    values = [task.dispatch_value(s) for s in shapes]
    tree = interval_tree(task.dispatch_var, values, [names[v] for v in labels])
    rows = []
    for shape, value, v in zip(shapes, values, labels, strict=True):
        variant, key = variants[v], shape_key(shape)
        was_measured = key in default_measured if variant is None else variant in measured.get(key, {})
        rows.append({"shape": shape, "value": value, "variant": names[v],
                     "latency_s": estimate(variant, shape), "measured": was_measured,
                     "default_latency_s": estimate(None, shape), "default_measured": key in default_measured})
    return KernelPlan(
        workload=workload_key(task.spec.func),
        operator=task.spec.name,
        shape_vars=sorted(task.spec.shape_vars),
        axes=task.axes,
        target=plan_target(task.target),
        tvm_version=str(tvm.__version__),
        variants={names[v]: (None if variants[v] is None else variants[v].to_dict()) for v in used},
        tree=tree,
        tuned_range={"var": task.dispatch_var, "min": min(values), "max": max(values)},
        shapes=rows,
        provenance={**provenance, "fixed": dict(task.fixed),
                    "weights": {str(v): w for v, w in zip(values, weights, strict=True) if w != 1.0}},
    )
