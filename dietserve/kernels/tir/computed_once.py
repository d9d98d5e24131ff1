"""Values a kernel computes once and then reads back as variables TVM's passes cannot see through."""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T


def computed_once(*values) -> list:
    """``values`` stored to a stack array and loaded back, as variables.

    A task's indices are often its number's quotient and remainder by a symbolic count: a
    packed whole-reduction task's block and row tile by the row tiles ``(T + mr - 1) // mr``
    (``cpu_packed/loop_nests.whole_reduction``), a clamped attention task's head and row block
    by the row blocks (``cpu_clamped/kernel.py``). As plain expressions those divisions sit in
    every address of the task, and TVM's lowering and LLVM spend most of a build on them. Read
    back from the stack they are plain values: the build is several times shorter and the FMA
    loops compile to the same vector instructions."""
    # (scope "global": a stack alloca; a "local" array inside a parallel body was allocated
    # through the runtime's workspace calls, once per task)
    dtype = str(max((value.ty.dtype for value in values), key=lambda d: d.bits))  # (the widest: none narrowed)
    stack = T.alloc_buffer((len(values),), dtype, scope="global")
    for index, value in enumerate(values):
        T.buffer_store(stack, tirx.Cast(dtype, value), [index])
    return [T.bind(stack[index]) for index in range(len(values))]


__all__ = ["computed_once"]
