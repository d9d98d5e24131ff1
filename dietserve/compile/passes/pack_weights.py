"""Feed packed weights to the kernels that read them, packing each weight once at load time.

The link pass replaces an operator with kernels that read its weight in panels
(``kernels/cpu_packed/packing.py``). Here every call site of such a kernel gets
``R.layout_transform(weight, panel map)`` on that argument, and ``LiftTransformParams`` moves
those transforms out of ``forward`` into ``forward_transform_params``: the runtime runs it once
when it loads the artifact (a few ms a weight), and every request streams packed panels. Layers
that share a weight share its packed copy; numerics are unchanged (a permutation). A bf16 build's
kernels read bf16 pairs instead (``kernels/cpu_packed/bf16.py``): there the argument is converted
by a small PrimFunc (``bf16_packing``), also lifted, so the weights are rounded once, at load.
"""

from __future__ import annotations

from collections.abc import Mapping

import tvm
from tvm import relax
from tvm.relax.expr import _update_type
from tvm.relax.expr_functor import PyExprMutator, mutator

from ...kernels.cpu_packed.bf16 import bf16_packing
from ...kernels.cpu_packed.packing import index_map

TRANSFORM_PARAMS_SUFFIX = "_transform_params"  # LiftTransformParams' naming


def pack_weight_arguments(mod: tvm.IRModule, packed: Mapping[str, tuple[int, int, str]]) -> tvm.IRModule:
    """``packed``: PrimFunc name -> (param index of its weight, panel width, precision). Returns
    ``mod`` with each such argument packed at the call site and the packing lifted out of the
    functions that take parameters (``num_input`` marks where inputs end)."""
    if not packed:
        return mod
    # The kernels' signatures changed: re-add them under fresh GlobalVars, which carry the new
    # parameter types (a GlobalVar keeps the type it was first given).
    callees = {name: tvm.ir.GlobalVar(name) for name in packed}
    for name, gvar in callees.items():
        _update_type(gvar, mod[name].ty)
    functions = {callees.get(gvar.name_hint, gvar): func for gvar, func in mod.functions_items()}
    mod = tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
    updated, conversions = {}, {}
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            updated[gvar] = _PackArguments(mod, packed, callees, conversions).visit_expr(func)
    for gvar, func in [*updated.items(), *conversions.values()]:
        mod[gvar] = func
    return tvm.transform.Sequential([
        relax.transform.LiftTransformParams(),
        relax.transform.LegalizeOps(),  # the lifted layout_transform is still a high-level op
        relax.transform.DeadCodeElimination(),
    ])(mod)


@mutator
class _PackArguments(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, packed: Mapping[str, tuple[int, int, str]], callees: Mapping,
                 conversions: dict):
        super().__init__(mod)
        self.packed = packed
        self.callees = callees
        self.conversions = conversions  # name -> (GlobalVar, PrimFunc) of the bf16 packings made

    def _bf16_packing(self, k: int, n: int, panel: int) -> tvm.ir.GlobalVar:
        name = f"bf16_pairs_{k}x{n}_p{panel}"
        if name not in self.conversions:
            func = bf16_packing(k, n, panel)
            gvar = tvm.ir.GlobalVar(name)
            _update_type(gvar, func.ty)
            self.conversions[name] = (gvar, func)
        return self.conversions[name][0]

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", None) != "relax.call_tir" or not isinstance(call.args[0], tvm.ir.GlobalVar):
            return call
        entry = self.packed.get(call.args[0].name_hint)
        if entry is None:
            return call
        param, panel, precision = entry
        arguments = list(call.args[1].fields)
        weight = arguments[param]
        if precision == "bf16":
            k, n = (int(extent) for extent in weight.ty.shape.values)
            pairs = relax.TensorType((n // panel, k // 2, panel), "uint32")
            arguments[param] = self.builder_.emit(relax.call_tir(self._bf16_packing(k, n, panel), [weight], pairs))
        else:
            arguments[param] = self.builder_.emit(relax.op.layout_transform(weight, index_map(panel)))
        callee = self.callees[call.args[0].name_hint]
        return relax.Call(call.op, [callee, relax.Tuple(arguments), *call.args[2:]], call.attrs,
                          call.ty_args, call.span)
