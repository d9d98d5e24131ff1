"""The decision tree compiled into the operator: one PrimFunc that branches on its own shape
expressions (nested ``IfThenElse``) between the variants' scheduled bodies, so callers see one
kernel for every shape and no Python runs per call."""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.target import Target

from .apply import apply_variant
from .cpu_packed.packing import packed_form
from .plan.decision_tree import evaluate_text, fold
from .plan.kernel_plan import KernelPlan
from .settings import KernelSettings, kernel_settings
from .tir.build import has_exact_buffers, has_own_storage, with_exact_buffers
from .tir.matching import symbolic_vars


def lower_tree(func: tirx.PrimFunc, tree: dict, leaf: Callable[[str], tirx.Stmt],
               thread_invariant: bool = False) -> tirx.Stmt:
    """The tree as TIR over ``func``'s symbolic vars; ``leaf(variant)`` gives each leaf's body.
    ``thread_invariant`` (CUDA): mark each condition as the same in every thread, which a shape
    test is; else TVM's ThreadSync refuses the ``__syncthreads`` of shared-memory variants inside
    it ("Cannot insert syncs inside condition")."""
    variables = symbolic_vars(func)

    def branch(var: str, le: int, then: tirx.Stmt, otherwise: tirx.Stmt) -> tirx.Stmt:
        quantity = evaluate_text(var, variables)
        if isinstance(quantity, int):
            raise ValueError(f"tree condition {var!r} does not depend on {sorted(variables)}")
        condition = quantity <= le
        return tirx.IfThenElse(tirx.op.tvm_thread_invariant(condition) if thread_invariant else condition,
                               then, otherwise)

    return fold(tree, leaf, branch)


def dispatched_prim_func(func: tirx.PrimFunc, plan: KernelPlan, target: Target, loop_partition: bool = False,
                         row_softmax: bool = False, settings: KernelSettings | None = None) -> tirx.PrimFunc:
    """``func`` with every variant of ``plan``, chosen per shape by the plan's tree;
    ``row_softmax``: each variant followed by a softmax over the result's rows (``apply_variant``);
    ``settings``: what every variant is built with (None: the target's own, ``kernel_settings``)."""
    settings = settings or kernel_settings(target)

    # Each leaf gets its own freshly scheduled copy: a variant reached by two leaves must not
    # share loop vars between them (the simplifier binds each var's range once per function).
    # Every variant is scheduled from ``func``, so they share its params and buffers.
    # A packed plan's variants all read the one packed weight: pack first, schedule from that.
    if plan.pack:
        func = packed_form(func, plan.pack)

    exact, own = [], []

    def leaf(name: str) -> tirx.Stmt:
        scheduled = apply_variant(func, plan.kernel(name), target, loop_partition, row_softmax, settings)
        exact.append(has_exact_buffers(scheduled))
        own.append(has_own_storage(scheduled))
        return scheduled.body

    body = lower_tree(func, plan.tree, leaf, thread_invariant=target.kind.name == "cuda")
    dispatched = func.with_body(body).with_attr("tirx.is_scheduled", True)
    # Buffer compaction (and StorageRewrite) is skipped only where no variant needs it (``tir/build.py``).
    return with_exact_buffers(dispatched, own_storage=all(own)) if all(exact) else dispatched
