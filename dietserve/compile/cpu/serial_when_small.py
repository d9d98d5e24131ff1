"""Small shapes run serial: each default-scheduled PrimFunc with a parallel loop nest gets a
serial copy of it too, taken where its output is at most ``SERIAL_UP_TO_ELEMENTS`` elements
(a branch on its symbolic shape, as the tuned kernels' decision trees are compiled in:
``kernels/decision_tree_func.py``).

A parallel loop wakes the thread pool and waits for its slowest thread (longer when a
neighbour holds a core), which at seq 1 costs more than the work: bert-base has about 100 such
launches a run besides the dense layers. Making every one serial pays at the shortest sequences
but costs a few percent from a few dozen rows on, hence the branch: serial only up to about 5
rows of bert-base's hidden size. ``compare_artifacts.py`` measures both sides of it.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.target import Target

from . import cpu_schedule_rules

SERIAL_UP_TO_ELEMENTS = 4096


def output_elements(func: tirx.PrimFunc):
    """The element count of ``func``'s output (its last buffer parameter, Relax's convention): an
    int, or an expression of its symbolic shape vars; None where it has no buffer parameter."""
    buffers = [p for p in func.params if isinstance(p.ty, tirx.buffer.BufferType)]
    if not buffers:
        return None
    shape = buffers[-1].ty.shape
    size = math.prod(int(d) for d in shape if isinstance(d, tirx.IntImm))
    symbolic = [d for d in shape if not isinstance(d, tirx.IntImm)]
    if not symbolic:
        return size
    expr = symbolic[0]
    for d in symbolic[1:]:
        expr = expr * d
    return expr * size


def serial_when_small(func: tirx.PrimFunc, parallel: tirx.PrimFunc, serial: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` (unscheduled) as ``parallel`` and ``serial`` (its two schedules) combined: the
    serial one up to ``SERIAL_UP_TO_ELEMENTS`` output elements, the parallel one above."""
    size = output_elements(func)
    if size is None or not all(isinstance(f.body, s_tir.SBlockRealize) for f in (serial, parallel)):
        return parallel
    if isinstance(size, int):
        return serial if size <= SERIAL_UP_TO_ELEMENTS else parallel
    # One root block, as Relax expects of a scheduled function, allocating what either root
    # did: both schedules allocate the function's own intermediate buffers, which may be
    # defined once only.
    serial_root, parallel_root = serial.body.block, parallel.body.block
    allocated = list(parallel_root.alloc_buffers)
    allocated += [b for b in serial_root.alloc_buffers if not any(b.same_as(a) for a in allocated)]
    branch = tirx.IfThenElse(size <= SERIAL_UP_TO_ELEMENTS, serial_root.body, parallel_root.body)
    root = s_tir.SBlock(iter_vars=[], reads=[], writes=[], name_hint="root", body=branch, alloc_buffers=allocated)
    return parallel.with_body(s_tir.SBlockRealize(iter_values=[], predicate=True, block=root))


def cpu_default_schedule() -> tvm.transform.Pass:
    """The CPU rules applied as dlight's ``ApplyDefaultSchedule`` applies them (the first rule
    that takes a PrimFunc schedules it; PrimFuncs already scheduled, the tuned kernels, are left
    alone), and a PrimFunc taken by a rule with a ``parallel`` flag is scheduled once more by
    its serial twin and branched between the two (``serial_when_small``)."""
    rules = cpu_schedule_rules()
    serial_twins = cpu_schedule_rules(parallel=False)

    @tvm.transform.module_pass(opt_level=0, name="dietserve.CPUDefaultSchedule")
    def schedule(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = Target.current(allow_none=False)
        updated = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or int(func.attrs.get("tirx.is_scheduled", 0)) == 1:
                continue
            for rule, twin in zip(rules, serial_twins, strict=True):
                sch = rule.apply(func, target, False)
                if sch is None:
                    continue
                scheduled = sch.mod["main"]
                if hasattr(rule, "parallel") and not relax.analysis.has_reshape_pattern(func):
                    # (a reshape is a view in Relax: no kernel runs, nothing to branch)
                    serial = twin.apply(func, target, False)
                    if serial is not None and not tvm_ffi.structural_equal(scheduled, serial.mod["main"]):
                        scheduled = serial_when_small(func, scheduled, serial.mod["main"])
                updated[gv] = scheduled.with_attr("tirx.is_scheduled", True)
                break
        return updated

    return schedule


__all__ = ["SERIAL_UP_TO_ELEMENTS", "cpu_default_schedule", "output_elements", "serial_when_small"]
