"""From measurements to a dispatch plan: a few micro-kernel variants and a decision tree that
sends each shape to its best one (DietCode's host-side dispatcher), and the single PrimFunc
that branches between the variants on the symbolic var.

Tree format (shared with ``dietserve.runtime.dispatch``): a leaf ``{"variant": name}`` or a
node ``{"var": name, "le": value, "then": subtree, "else": subtree}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tvm import tirx

from .space.microkernel import MicroKernel

Estimate = Callable[[MicroKernel, dict], float]  # (kernel, shape) -> latency seconds


@dataclass
class DispatchPlan:
    workload: str
    target: str
    var: str  # the symbolic var the tree branches on
    variants: dict[str, str]  # variant name -> MicroKernel.to_json()
    tree: dict
    shapes: list[dict] = field(default_factory=list)  # per instance: shape, variant, latency, measured
    meta: dict = field(default_factory=dict)

    def kernel(self, name: str) -> MicroKernel:
        return MicroKernel.from_json(self.variants[name])

    def variant_for(self, shape: Mapping[str, int]) -> str:
        node = self.tree
        while "variant" not in node:
            node = node["then"] if shape[node["var"]] <= node["le"] else node["else"]
        return node["variant"]

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DispatchPlan:
        return cls(**json.loads(text))


def choose_variants(kernels: Sequence[MicroKernel], shapes: Sequence[dict], weights: Sequence[float],
                    estimate: Estimate, max_variants: int) -> tuple[list[MicroKernel], list[int], list[float]]:
    """Greedy set cover of the weighted total latency: add the kernel that lowers it most,
    up to ``max_variants``. Returns (variants, per-shape variant index, per-shape latency)."""
    table = [[estimate(kernel, shape) for shape in shapes] for kernel in kernels]
    chosen: list[int] = []
    best = [float("inf")] * len(shapes)
    for _round in range(max_variants):
        def total_with(candidate: int, best: list[float] = best) -> float:
            return sum(w * min(b, table[candidate][s]) for s, (w, b) in enumerate(zip(weights, best, strict=False)))

        remaining = [c for c in range(len(kernels)) if c not in chosen]
        if not remaining:
            break
        pick = min(remaining, key=total_with)
        if chosen and total_with(pick) >= sum(w * b for w, b in zip(weights, best, strict=False)) * 0.995:
            break  # another variant would not pay for its code size
        chosen.append(pick)
        best = [min(b, table[pick][s]) for s, b in enumerate(best)]
    assignment = [min(range(len(chosen)), key=lambda v, s=s: table[chosen[v]][s]) for s in range(len(shapes))]
    latency = [table[chosen[v]][s] for s, v in enumerate(assignment)]
    return [kernels[c] for c in chosen], assignment, latency


def interval_tree(var: str, values: Sequence[int], labels: Sequence[str]) -> dict:
    """A balanced decision tree over ``var`` from (sorted value -> label) runs."""
    pairs = sorted(zip(values, labels, strict=False))
    runs: list[tuple[int, str]] = []  # (last value of the run, label)
    for value, label in pairs:
        if runs and runs[-1][1] == label:
            runs[-1] = (value, label)
        else:
            runs.append((value, label))

    def build(lo: int, hi: int) -> dict:
        if lo == hi:
            return {"variant": runs[lo][1]}
        mid = (lo + hi) // 2
        return {"var": var, "le": runs[mid][0], "then": build(lo, mid), "else": build(mid + 1, hi)}

    return build(0, len(runs) - 1) if runs else {}


def dispatched_prim_func(func: tirx.PrimFunc, plan: DispatchPlan, target_kind: str,
                         loop_partition: bool = False) -> tirx.PrimFunc:
    """One PrimFunc holding every variant, branching on the plan's var: the decision tree
    compiled into the operator itself, so callers see one kernel for all shapes."""
    from .extract import symbolic_vars
    from .schedule import apply_kernel

    variables = symbolic_vars(func)
    if plan.var not in variables:
        raise ValueError(f"plan branches on {plan.var!r}, the function's vars are {sorted(variables)}")
    var = variables[plan.var]
    # Each leaf gets its own freshly scheduled copy: a variant reached by two leaves must not
    # share loop vars between them (the simplifier binds each var's range once per function).
    def lower(node: dict) -> tirx.Stmt:
        if "variant" in node:
            return apply_kernel(func, plan.kernel(node["variant"]), target_kind, loop_partition).body
        condition = var <= tirx.IntImm(str(var.ty.dtype), int(node["le"]))
        return tirx.IfThenElse(condition, lower(node["then"]), lower(node["else"]))

    # Every variant is scheduled from ``func``, so they share its params and buffers.
    return func.with_body(lower(plan.tree)).with_attr("tirx.is_scheduled", True)
