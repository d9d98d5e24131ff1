"""One mechanism for the passes that swap a Relax operator for our own implementation."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

# (the rewriter's block builder, the call) -> the replacement, or None to keep the call
Replacement = Callable[[relax.BlockBuilder, relax.Call], relax.Expr | None]


def replace_op_pass(name: str, op_name: str, replacement: Replacement) -> tvm.transform.Pass:
    """A module pass that offers every call of ``op_name`` in the Relax functions to
    ``replacement``."""

    @relax.expr_functor.mutator
    class _Rewriter(relax.PyExprMutator):
        def visit_call_(self, call: relax.Call) -> relax.Expr:
            call = super().visit_call_(call)
            if isinstance(call.op, tvm.ir.Op) and call.op.name == op_name:
                replaced = replacement(self.builder_, call)
                if replaced is not None:
                    return replaced
            return call

    @tvm.transform.module_pass(opt_level=0, name=name)
    def rewrite(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()

    return rewrite


def float32_te_replacement(te_function, name: str) -> Replacement:
    """A replacement computing a float32 call's one argument by ``te_function`` (a PrimFunc named
    ``name``); calls of other dtypes are kept."""
    def replace(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        if call.args[0].ty.dtype != "float32":
            return None
        return builder.call_te(te_function, call.args[0], primfunc_name_hint=name)

    return replace
