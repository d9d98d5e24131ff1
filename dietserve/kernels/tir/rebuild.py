"""Rebuild a TIR expression with variables substituted and buffer loads replaced: how a kernel
built with the IR builder reuses an operator's own expressions (TVM 0.27 exposes no TIR
substitution to Python); and ``MatmulExpressions``, the expressions such a kernel starts from."""

from __future__ import annotations

import types

import tvm
from tvm import s_tir, tirx

from .matching import ScheduleMismatch, find_matmul, is_multiply_accumulate

_BINARY = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max,
           tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.And, tirx.Or, tirx.LShift, tirx.RShift,
           tirx.BitwiseAnd, tirx.BitwiseOr, tirx.BitwiseXor)


def rebuild(expr, variables: dict, loads: dict | None = None, on_var=None, on_load=None, on_node=None) -> tirx.Expr:
    """``expr`` with ``variables`` substituted and loads of the buffers in ``loads`` replaced by
    the given expressions (or by what a given function returns for the load); ``on_var`` /
    ``on_load`` / ``on_node`` see every variable / buffer load / node met."""
    loads = loads or {}
    variables = dict(variables)

    def visit(node):
        if on_node is not None:
            on_node(node)
        if isinstance(node, tirx.Var):
            if on_var is not None:
                on_var(node)
            return next((new for old, new in variables.items() if old.same_as(node)), node)
        if isinstance(node, tirx.IntImm | tirx.FloatImm | tvm.ir.StringImm):
            return node
        if isinstance(node, tvm.ir.TensorLoad):
            if on_load is not None:
                on_load(node)
            for buffer, replacement in loads.items():
                if node.source.same_as(buffer):
                    return replacement(node) if isinstance(replacement, types.FunctionType) else replacement
            return tirx.BufferLoad(node.source, [visit(index) for index in node.indices])
        if isinstance(node, _BINARY):
            return type(node)(*_same_lanes(visit(node.a), visit(node.b)))
        if isinstance(node, tirx.Not):
            return tirx.Not(visit(node.a))
        if isinstance(node, tirx.Cast):
            return tirx.Cast(node.ty, visit(node.value))
        if isinstance(node, tirx.Select):
            return tirx.Select(visit(node.condition), visit(node.true_value), visit(node.false_value))
        if isinstance(node, tvm.ir.Call):
            return tvm.ir.Call(node.op, [visit(arg) for arg in node.args], node.attrs, node.ty_args, ret_ty=node.ty)
        if isinstance(node, tirx.Let):
            # a fresh variable per rebuilt copy: a kernel may hold many copies, and one variable
            # bound in two places is not SSA (the vectoriser refuses it)
            fresh = tirx.Var(node.var.name, node.var.ty)
            value = visit(node.value)
            variables[node.var] = fresh
            return tirx.Let(fresh, value, visit(node.body))
        raise ScheduleMismatch(f"cannot rebase expression node {type(node).__name__} onto a tile")

    return visit(expr)


def _same_lanes(a, b):
    """``a``, ``b`` with a scalar broadcast to the other's vector lanes (a vector substituted
    for a variable: ``Tile.panel_vectors``)."""
    lanes_a, lanes_b = a.ty.dtype.lanes, b.ty.dtype.lanes
    if lanes_a == lanes_b:
        return a, b
    return (tirx.Broadcast(a, lanes_b), b) if lanes_a == 1 else (a, tirx.Broadcast(b, lanes_a))


def expression_size(expr) -> int:
    """How many nodes ``expr`` has (a ``Let``'s value counted once)."""
    count = [0]

    def on_node(_node) -> None:
        count[0] += 1

    rebuild(expr, {}, on_node=on_node)
    return count[0]


def reads(expr, buffer) -> bool:
    """Whether ``expr`` loads from ``buffer``."""
    found = []
    rebuild(expr, {}, on_load=lambda load: found.append(load.source.same_as(buffer)))
    return any(found)


def uses(expr, var) -> bool:
    found = []
    rebuild(expr, {}, on_var=lambda v: found.append(v.same_as(var)))
    return any(found)


class MatmulExpressions:
    """A matmul-like PrimFunc's parts, for a kernel built with the IR builder: the reduction
    block's iteration variables and loop extents, its result buffer and product term, and its
    element-wise epilogue (``out``, ``out_vars``, ``epilogue``: the store's buffer, variables
    and value; ``epilogue`` is None when the result is the output). Each kernel family checks
    the shapes it needs on top."""

    def __init__(self, func: tirx.PrimFunc):
        sch = s_tir.Schedule(func)
        block, epilogue = find_matmul(sch)
        stmt = sch.get(block)
        if not is_multiply_accumulate(stmt):
            raise ScheduleMismatch("the reduction is not a multiply-accumulate")
        self.iter_vars = [iv.var for iv in stmt.iter_vars]
        self.extents = [sch.get(loop).extent for loop in sch.get_loops(block)]
        if len(self.extents) != len(self.iter_vars):
            raise ScheduleMismatch("expected a matmul block with its own loops")
        self.result_indices = list(stmt.body.indices)
        self.result = stmt.body.buffer
        self.product = stmt.body.value.b
        self.out, self.out_vars, self.epilogue = self.result, self.iter_vars[:-1], None
        if epilogue is not None:
            block_stmt = sch.get(epilogue)
            store = getattr(block_stmt, "body", None)
            out_vars = [iv.var for iv in block_stmt.iter_vars]
            if not isinstance(store, tirx.BufferStore):
                raise ScheduleMismatch("the epilogue is not one element-wise store over the result")
            if [str(i) for i in store.indices] != [str(v) for v in out_vars]:
                raise ScheduleMismatch("the epilogue does not write the element it computes")
            self.out, self.out_vars, self.epilogue = store.buffer, out_vars, store.value
