"""Link tuned kernels into the model: the pipeline's IRModule -> IRModule slot for plans.

Every PrimFunc that is a dynamic matmul-like operator is tagged with its workload key (so the
artifact can list the operators that have kernels, tuned or not). Those whose key has a plan are
replaced by one PrimFunc holding every variant of the plan, branching on the operator's own
shape expressions (``dietserve.kernels.decision_tree_func``), marked scheduled so the default rules leave
them alone. Matching is by structure (the workload key), never by the function's name.
A plan whose kernels read packed weights also gets its weight argument packed, once, at load
(``pack_weights.py``). On CPU, an operator with a plan whose result only feeds a softmax over
its last axis (attention's scores) is fused with it (``fuse_softmax.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import tirx
from tvm.target import Target

from ...kernels.cpu_packed.bf16 import precision_of
from ...kernels.cpu_packed.packing import packed_panel, weight_param, with_precision
from ...kernels.decision_tree_func import dispatched_prim_func
from ...kernels.plan.kernel_plan import KernelPlan, PlanError
from ...kernels.tir.matching import is_dynamic_matmul, workload_key
from .fuse_softmax import fuse_scores_softmax
from .pack_weights import pack_weight_arguments

WORKLOAD_ATTR, PLAN_ATTR = "dietserve.workload", "dietserve.plan"  # in matching.NAMING_ATTRS


def link_tuned_kernels(plans: Sequence[KernelPlan], target: Target, tvm_version: str,
                       precision: str = "fp32") -> tvm.transform.Pass:
    """Plans must be for ``target``, this TVM and ``precision``. A plan that matches no operator
    is left out here; ``foreign_plans`` names it once the build is inspected. With ``bf16``, the
    dense layers whose plans read packed weights are built with bf16 products."""
    by_workload = {plan.workload: plan for plan in plans}
    for plan in plans:
        plan.check_target(target_fields(target), tvm_version)
        plan.check_precision(precision)

    @tvm.transform.module_pass(opt_level=0, name="LinkTunedKernels")
    def link(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updated, packed, fusable = {}, {}, {}
        for gvar, func in mod.functions_items():
            if not is_dynamic_matmul(func):
                continue
            key = workload_key(func)
            plan = by_workload.get(key)
            if plan is None:
                updated[gvar] = func.with_attr(WORKLOAD_ATTR, key)
                continue
            if plan.pack:  # (an unpacked plan's kernels read fp32 weights: the default rule's and clamped tiles)
                func = with_precision(func, precision)
            dispatched = dispatched_prim_func(func, plan, target)
            updated[gvar] = dispatched.with_attr(WORKLOAD_ATTR, key).with_attr(PLAN_ATTR, plan.digest())
            if plan.pack:
                packed[gvar.name_hint] = (weight_param(func)[0], plan.pack, precision_of(func))
            elif target.kind.name == "llvm":
                fusable[gvar.name_hint] = _fused_softmax_builder(func, plan, key)
        for gvar, func in updated.items():
            mod[gvar] = func
        return pack_weight_arguments(fuse_scores_softmax(mod, fusable), packed)

    def _fused_softmax_builder(func, plan: KernelPlan, key: str):
        def build():
            fused = dispatched_prim_func(func, plan, target, row_softmax=True)
            return fused.with_attr(WORKLOAD_ATTR, key).with_attr(PLAN_ATTR, plan.digest())
        return build

    return link


def foreign_plans(plans: Sequence[KernelPlan], operators: dict[str, dict]) -> None:
    """Raise PlanError for a plan that ``linked_operators`` shows was linked nowhere: it was
    tuned for an operator this model does not have."""
    linked = {entry["plan"] for entry in operators.values()}
    for plan in plans:
        if plan.digest() not in linked:
            model = plan.provenance.get("model", {}).get("name", "another model")
            raise PlanError(f"plan for {plan.operator} (workload {plan.workload}, tuned from {model}) matches no "
                            f"operator of this model: a foreign plan; tune this model instead")


def target_fields(target: Target) -> dict:
    """kind, mcpu, arch as the plans record them."""
    fields = {"kind": target.kind.name}
    for key in ("mcpu", "arch"):
        if key in target.attrs:
            fields[key] = str(target.attrs[key])
    return fields


def linked_operators(mod: tvm.IRModule) -> dict[str, dict]:
    """PrimFunc name -> {workload, plan digest or None, calls, packed_panel, precision} for every
    tagged operator of a (scheduled) module; ``calls`` counts the Relax call sites, so one per
    layer; ``packed_panel`` is the weight's panel width (0: unpacked); ``precision`` its products'."""
    calls = call_counts(mod)
    found = {}
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and WORKLOAD_ATTR in func.attrs:
            plan = func.attrs[PLAN_ATTR] if PLAN_ATTR in func.attrs else None
            found[gvar.name_hint] = {"workload": str(func.attrs[WORKLOAD_ATTR]),
                                     "plan": None if plan is None else str(plan),
                                     "calls": calls.get(gvar.name_hint, 0),
                                     "packed_panel": packed_panel(func), "precision": precision_of(func)}
    return dict(sorted(found.items()))


def call_counts(mod: tvm.IRModule) -> dict[str, int]:
    """PrimFunc name -> how many ``call_tir`` sites the module's Relax functions have for it."""
    from tvm import relax

    calls: dict[str, int] = {}
    for _gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            for name in _called_prim_funcs(func):
                calls[name] = calls.get(name, 0) + 1
    return calls


def _called_prim_funcs(func) -> list[str]:
    from tvm import relax

    names: list[str] = []

    def visit(expr) -> None:
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", None) == "relax.call_tir":
            callee = expr.args[0]
            if isinstance(callee, tvm.ir.GlobalVar):
                names.append(callee.name_hint)

    relax.analysis.post_order_visit(func, visit)
    return names
