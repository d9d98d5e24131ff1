"""The decision tree compiled into the operator: one PrimFunc that branches on its own shape
expressions (nested ``IfThenElse``) between the variants' scheduled bodies, so callers see one
kernel for every shape and no Python runs per call."""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.target import Target

from .apply import apply_variant
from .matching import symbolic_vars
from .packing import packed_form
from .plan import KernelPlan
from .tree import evaluate_text, fold


def lower_tree(func: tirx.PrimFunc, tree: dict, leaf: Callable[[str], tirx.Stmt]) -> tirx.Stmt:
    """The tree as TIR over ``func``'s symbolic vars; ``leaf(variant)`` gives each leaf's body."""
    variables = symbolic_vars(func)

    def branch(var: str, le: int, then: tirx.Stmt, otherwise: tirx.Stmt) -> tirx.Stmt:
        quantity = evaluate_text(var, variables)
        if isinstance(quantity, int):
            raise ValueError(f"tree condition {var!r} does not depend on {sorted(variables)}")
        return tirx.IfThenElse(quantity <= le, then, otherwise)

    return fold(tree, leaf, branch)


def dispatched_prim_func(func: tirx.PrimFunc, plan: KernelPlan, target: Target,
                         loop_partition: bool = False) -> tirx.PrimFunc:
    """``func`` with every variant of ``plan``, chosen per shape by the plan's tree."""

    # Each leaf gets its own freshly scheduled copy: a variant reached by two leaves must not
    # share loop vars between them (the simplifier binds each var's range once per function).
    # Every variant is scheduled from ``func``, so they share its params and buffers.
    # A packed plan's variants all read the one packed weight: pack first, schedule from that.
    if plan.pack:
        func = packed_form(func, plan.pack)

    def leaf(name: str) -> tirx.Stmt:
        return apply_variant(func, plan.kernel(name), target, loop_partition).body

    return func.with_body(lower_tree(func, plan.tree, leaf)).with_attr("tirx.is_scheduled", True)
