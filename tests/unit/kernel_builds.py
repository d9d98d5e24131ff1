"""Every kernel of a space applied to one operator and built, for the tests that check them all
against numpy: in two modules on two threads, as TVM's build releases the GIL and LLVM's code
generation then uses both cores (one module of a space's two hundred kernels takes minutes)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import tvm

from dietserve.kernels.apply import apply_kernel
from dietserve.kernels.tir.build import build

PARTS = 2


def build_each(func: tvm.tirx.PrimFunc, kernels: list, target: tvm.target.Target, where="llvm",
               settings=None) -> list:
    """One built function per kernel, in the kernels' order; ``where`` is the target the
    schedules are applied for (its core count decides their task split); ``settings``: the
    kernels' (None: ``where``'s own)."""
    named = {f"k{i}": apply_kernel(func, kernel, where, settings=settings).with_attr("global_symbol", f"k{i}")
             for i, kernel in enumerate(kernels)}
    groups = [group for group in (list(named)[part::PARTS] for part in range(PARTS)) if group]
    with ThreadPoolExecutor(len(groups)) as pool:
        modules = list(pool.map(lambda group: build(tvm.IRModule({n: named[n] for n in group}), target), groups))
    owner = {name: module for module, group in zip(modules, groups, strict=True) for name in group}
    return [owner[name][name] for name in named]
