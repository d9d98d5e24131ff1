"""Rebuild a TIR expression with variables substituted and buffer loads replaced: how a kernel
built with the IR builder reuses an operator's own expressions (TVM 0.27 exposes no TIR
substitution to Python)."""

from __future__ import annotations

import tvm
from tvm import tirx

from .matching import ScheduleMismatch

_BINARY = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max,
           tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.And, tirx.Or, tirx.LShift, tirx.RShift,
           tirx.BitwiseAnd, tirx.BitwiseOr, tirx.BitwiseXor)


def rebuild(expr, variables: dict, loads: dict | None = None, loads_seen=None, on_var=None) -> tirx.Expr:
    """``expr`` with ``variables`` substituted and loads of the buffers in ``loads`` replaced by
    the given expressions ``loads_seen``
    (buffer, list) collects the loads of one buffer."""
    loads = loads or {}

    def visit(node):
        if isinstance(node, tirx.Var):
            if on_var is not None:
                on_var(node)
            return next((new for old, new in variables.items() if old.same_as(node)), node)
        if isinstance(node, tirx.IntImm | tirx.FloatImm | tvm.ir.StringImm):
            return node
        if isinstance(node, tvm.ir.TensorLoad):
            if loads_seen is not None and node.source.same_as(loads_seen[0]):
                loads_seen[1].append(node)
            for buffer, replacement in loads.items():
                if node.source.same_as(buffer):
                    return replacement
            return tirx.BufferLoad(node.source, [visit(index) for index in node.indices])
        if isinstance(node, _BINARY):
            return type(node)(visit(node.a), visit(node.b))
        if isinstance(node, tirx.Not):
            return tirx.Not(visit(node.a))
        if isinstance(node, tirx.Cast):
            return tirx.Cast(node.ty, visit(node.value))
        if isinstance(node, tirx.Select):
            return tirx.Select(visit(node.condition), visit(node.true_value), visit(node.false_value))
        if isinstance(node, tvm.ir.Call):
            return tvm.ir.Call(node.op, [visit(arg) for arg in node.args], node.attrs, node.ty_args, ret_ty=node.ty)
        raise ScheduleMismatch(f"cannot rebase expression node {type(node).__name__} onto a tile")

    return visit(expr)


def uses(expr, var) -> bool:
    found = []
    rebuild(expr, {}, on_var=lambda v: found.append(v.same_as(var)))
    return any(found)
