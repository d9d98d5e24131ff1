"""The plan a tuner's measurements lead to: the variants a plan may take, each one's estimated
latency on every shape (as timed, and as served), and the dispatch plan made from them.

A part of ``tune.Tuner`` by role, as ``commitment.py`` is: it reads the tuner's measurements and
changes nothing. The packing commitment and the verification (``commitment.py``), the races
(``race.py``) and the tune's final plan all plan through here, so they rank variants alike.
"""

from __future__ import annotations

from dietserve.kernels.microkernel import MicroKernel
from dietserve.kernels.plan import KernelPlan

from .dispatch import build_plan, plan_layouts
from .estimates import nearest_measured_estimates
from .weight_stream import served_estimates


def plan_candidates(tuner) -> list[MicroKernel | None]:
    """The variants a plan of ``tuner`` (a ``tune.Tuner``) may take: measured kernels (of the
    committed packing once there is one) and, where it was measured, the default kernel (None)."""
    candidates: list[MicroKernel | None] = [k for k in tuner.calibrated() if k not in tuner.failed]
    if tuner.packing is not None:
        # Only the committed packing's kernels (and the untuned one): its small-regime and
        # single-pass tiles are the ones probed. Another packing's kernels measured before the
        # commit took a bert-base tune's 3072 -> 768 layer back to 32-wide panels, none of
        # its tiles covering T = 10-13 (seq 11-13 0.89-0.91x end to end).
        candidates = [k for k in candidates if k.pack == tuner.packing]
    if tuner.default_measured:
        candidates.append(None)
    return candidates


def ranking(tuner):
    """(hot, served): the latency estimates a plan is made from, each a function of (variant,
    shape): as timed (the weight in cache), and as served (the weight from DRAM, where the rates
    are known, with the streamed races' corrections)."""
    estimate = nearest_measured_estimates(tuner.task, tuner.measured, tuner.default_measured, tuner.cores)
    return estimate, served_estimates(estimate, tuner.task, tuner.options.dram, tuner.corrections)


def make_plan(tuner, provenance: dict) -> KernelPlan:
    """The best plan over ``tuner``'s measurements (``dispatch.plan_layouts``: one weight layout
    per plan, least weighted slowdown), chosen as served; its rows keep the latencies as timed.
    Raises RuntimeError where no candidate was measured successfully."""
    candidates = plan_candidates(tuner)
    if not candidates:
        raise RuntimeError(f"no candidate of {tuner.task.workload} measured successfully in {tuner.trials} trials"
                           f" ({tuner.failures} failed); see the records for their errors")
    task = tuner.task
    order = sorted(range(len(tuner.shapes)), key=lambda s: task.dispatch_value(tuner.shapes[s]))
    shapes = [tuner.shapes[s] for s in order]
    weights = [tuner.weights[s] for s in order]
    estimate, served = ranking(tuner)
    variants, labels = plan_layouts(candidates, shapes, weights, served, tuner.measured, tuner.default_measured,
                                    tuner.options.max_variants, tuner.options.max_intervals,
                                    rows=[task.axis_extents(shape)["i"] for shape in shapes],
                                    tallest=tuner.tallest_tiles)
    return build_plan(task, variants, labels, shapes, weights, estimate, tuner.measured, tuner.default_measured,
                      provenance)


__all__ = ["make_plan", "plan_candidates", "ranking"]
