"""Fuse attention's masked softmax into its scores kernel, where the scores have a tuned plan.

The model computes ``probs = softmax(Q @ Kt * scale + mask)`` as two kernels: the scores
(a matmul-like operator the link pass gives tuned kernels) and TOPI's ``fast_softmax``. The
``[b, h, T, T]`` scores then make a round trip through memory between them (12.6 MB a layer
for bert-base at T = 512). Here each ``softmax(scores(...))`` pair of ``call_tir``s becomes one
call of a kernel that softmaxes each task's rows in place as soon as it has written them
(``kernels/cpu_clamped/kernel.py``), and the unfused pair is dropped. The softmax is recognised by
structure (``kernels/row_softmax.is_last_axis_softmax``), never by name.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ...kernels.tir.matching import ScheduleMismatch
from ...kernels.tir.row_softmax import is_last_axis_softmax

FUSED_SUFFIX = "_softmax"


def fuse_scores_softmax(mod: tvm.IRModule, fusable: dict[str, Callable[[], tirx.PrimFunc]]) -> tvm.IRModule:
    """``fusable``: scores PrimFunc name -> a builder of its fused scores+softmax PrimFunc
    (same parameters, its output the probabilities). Returns ``mod`` with every
    ``softmax(scores)`` pair whose scores have no other use replaced by the fused kernel."""
    if not fusable:
        return mod
    softmax = {gvar.name_hint for gvar, func in mod.functions_items()
               if isinstance(func, tirx.PrimFunc) and is_last_axis_softmax(func)}
    if not softmax:
        return mod
    uses = _use_counts(mod)
    builder = relax.BlockBuilder(mod)
    fused: dict[str, tvm.ir.GlobalVar | None] = {}

    def fused_callee(name: str) -> tvm.ir.GlobalVar | None:
        if name not in fused:
            try:
                fused[name] = builder.add_func(fusable[name](), name + FUSED_SUFFIX)
            except ScheduleMismatch:  # its kernels cannot carry the softmax: leave the pair as it is
                fused[name] = None
        return fused[name]

    rewriter = _Fuse(builder.get(), set(fusable), softmax, uses, fused_callee)
    for gvar, func in builder.get().functions_items():
        if isinstance(func, relax.Function):
            builder.update_func(gvar, rewriter.visit_expr(func))
    if not any(fused.values()):
        return mod
    return relax.transform.DeadCodeElimination()(builder.get())


def softmaxed_operators(mod: tvm.IRModule) -> set[str]:
    """Names of the PrimFuncs whose result feeds nothing but a last-axis softmax: the pairs
    ``fuse_scores_softmax`` would make one kernel, so their tuning task times them fused, as
    they are served. ``mod`` is left as it is."""
    softmax = {gvar.name_hint for gvar, func in mod.functions_items()
               if isinstance(func, tirx.PrimFunc) and is_last_axis_softmax(func)}
    if not softmax:
        return set()
    found: set[str] = set()

    def note(name: str) -> None:  # a producer the rewrite would fuse; nothing is rewritten
        found.add(name)

    prim_funcs = {gvar.name_hint for gvar, func in mod.functions_items() if isinstance(func, tirx.PrimFunc)}
    finder = _Fuse(mod, prim_funcs - softmax, softmax, _use_counts(mod), note)
    for _gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            finder.visit_expr(func)
    return found


@mutator
class _Fuse(PyExprMutator):
    def __init__(self, mod, scores: set, softmax: set, uses: dict, fused_callee):
        super().__init__(mod)
        self.scores, self.softmax, self.uses, self.fused_callee = scores, softmax, uses, fused_callee

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if _callee(call) not in self.softmax or len(call.args[1].fields) != 1:
            return call
        source = call.args[1].fields[0]
        if not isinstance(source, relax.Var) or self.uses.get(source.name, 0) != 1:
            return call
        producer = self.lookup_binding(source)
        if producer is None or _callee(producer) not in self.scores:
            return call
        callee = self.fused_callee(_callee(producer))
        if callee is None:
            return call
        return relax.Call(producer.op, [callee, *producer.args[1:]], producer.attrs, call.ty_args, call.span)


def _callee(call) -> str | None:
    if (isinstance(call, relax.Call) and getattr(call.op, "name", None) == "relax.call_tir"
            and isinstance(call.args[0], tvm.ir.GlobalVar)):
        return call.args[0].name_hint
    return None


def _use_counts(mod: tvm.IRModule) -> dict[str, int]:
    """Relax var name -> how many expressions use it (names are unique within a function)."""
    counts: dict[str, int] = {}
    for _gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            def visit(expr) -> None:
                if isinstance(expr, relax.Var):  # TIR shape vars too (one Var class): harmless
                    counts[expr.name] = counts.get(expr.name, 0) + 1

            relax.analysis.post_order_visit(func, visit)
    return counts
