"""The WMMA tensor intrinsics the tensor-core kernels are tensorized with, registered on first use.

Each is TVM's own (``tvm.s_tir.tensor_intrin.cuda``: the same descriptions and the same
``tvm_load_matrix_sync``/``tvm_fill_fragment``/``tvm_mma_sync``/``tvm_store_matrix_sync`` calls)
for the one shape used here: 16x16x16, row-major fp16 operands, fp32 accumulator. Importing TVM's
module instead registers every intrinsic TVM has for every target, which takes far longer than
building the kernels.
"""

from __future__ import annotations

import functools

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

F = 16  # the fragment's m, n and k
OPERAND, ACCUMULATOR = "float16", "float32"


def _fragment_index(buffer, stride):
    """Which fragment of a fragment-scoped buffer ``buffer`` is (as TVM's intrinsics number them)."""
    return buffer.elem_offset // stride // F * (stride // F) + buffer.elem_offset % stride // F


def _copy(dtype: str, source: str, destination: str, call):
    """A 16x16 copy between scopes, implemented by ``call(src, dst, src_stride, dst_stride)``."""

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        src = T.match_buffer(a, (F, F), dtype, align=64, offset_factor=F, scope=source)
        dst = T.match_buffer(c, (F, F), dtype, align=64, offset_factor=F, scope=destination)
        with T.sblock("root"):
            T.reads(src[0:F, 0:F])
            T.writes(dst[0:F, 0:F])
            for i, j in T.grid(F, F):
                with T.sblock("copy"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    dst[vi, vj] = src[vi, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s1, s0, d1, d0 = T.int32(), T.int32(), T.int32(), T.int32()
        src = T.match_buffer(a, (F, F), dtype, align=64, offset_factor=F, scope=source, strides=[s1, s0])
        dst = T.match_buffer(c, (F, F), dtype, align=64, offset_factor=F, scope=destination, strides=[d1, d0])
        with T.sblock("root"):
            T.reads(src[0:F, 0:F])
            T.writes(dst[0:F, 0:F])
            T.evaluate(call(src, dst, s1, d1))

    return desc, impl


def _load(operand: str, scope: str):
    def call(src, dst, src_stride, dst_stride):
        return T.tvm_load_matrix_sync(dst.data, F, F, F, _fragment_index(dst, dst_stride),
                                      src.access_ptr("r", ptr_type=OPERAND), src_stride, "row_major", dtype="void")

    return _copy(OPERAND, scope, f"wmma.matrix_{operand}", call)


def _store(scope: str):
    def call(src, dst, src_stride, dst_stride):
        return T.tvm_store_matrix_sync(src.data, F, F, F, _fragment_index(src, src_stride),
                                       dst.access_ptr("w", ptr_type=ACCUMULATOR), dst_stride, "row_major",
                                       dtype="void")

    return _copy(ACCUMULATOR, "wmma.accumulator", scope, call)


def _fill():
    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        acc = T.match_buffer(c, (F, F), ACCUMULATOR, align=64, offset_factor=F, scope="wmma.accumulator")
        with T.sblock("root"):
            T.reads()
            T.writes(acc[0:F, 0:F])
            for i, j in T.grid(F, F):
                with T.sblock("init"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    acc[vi, vj] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        d1, d0 = T.int32(), T.int32()
        acc = T.match_buffer(c, (F, F), ACCUMULATOR, align=64, offset_factor=F, scope="wmma.accumulator",
                             strides=[d1, d0])
        with T.sblock("root"):
            T.reads()
            T.writes(acc[0:F, 0:F])
            T.evaluate(T.tvm_fill_fragment(acc.data, F, F, F, _fragment_index(acc, d1), T.float32(0), dtype="void"))

    return desc, impl


def _sync():
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        x = T.match_buffer(a, (F, F), OPERAND, align=64, offset_factor=F, scope="wmma.matrix_a")
        y = T.match_buffer(b, (F, F), OPERAND, align=64, offset_factor=F, scope="wmma.matrix_b")
        acc = T.match_buffer(c, (F, F), ACCUMULATOR, align=64, offset_factor=F, scope="wmma.accumulator")
        with T.sblock("root"):
            T.reads(acc[0:F, 0:F], x[0:F, 0:F], y[0:F, 0:F])
            T.writes(acc[0:F, 0:F])
            for i, j, k in T.grid(F, F, F):
                with T.sblock(""):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    acc[vi, vj] = acc[vi, vj] + T.Cast(ACCUMULATOR, x[vi, vk]) * T.Cast(ACCUMULATOR, y[vk, vj])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        a1, a0, b1, b0, c1, c0 = T.int32(), T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        x = T.match_buffer(a, (F, F), OPERAND, align=64, offset_factor=F, scope="wmma.matrix_a", strides=[a1, a0])
        y = T.match_buffer(b, (F, F), OPERAND, align=64, offset_factor=F, scope="wmma.matrix_b", strides=[b1, b0])
        acc = T.match_buffer(c, (F, F), ACCUMULATOR, align=64, offset_factor=F, scope="wmma.accumulator",
                             strides=[c1, c0])
        with T.sblock("root"):
            T.reads(acc[0:F, 0:F], x[0:F, 0:F], y[0:F, 0:F])
            T.writes(acc[0:F, 0:F])
            T.evaluate(T.tvm_mma_sync(acc.data, _fragment_index(acc, c1), x.data, _fragment_index(x, a1),
                                      y.data, _fragment_index(y, b1), acc.data, _fragment_index(acc, c1),
                                      dtype="void"))

    return desc, impl


@functools.cache
def wmma_intrinsics(operand_scope: str, result_scope: str) -> dict[str, str]:
    """Names of the registered intrinsics for operand and result tiles in these shared scopes:
    load_a, load_b, init, compute, store (as ``get_wmma_intrin_group`` names TVM's)."""
    operands, result = operand_scope.replace(".", "_"), result_scope.replace(".", "_")
    definitions = {f"dietserve_wmma_load_a_{operands}": lambda: _load("a", operand_scope),
                   f"dietserve_wmma_load_b_{operands}": lambda: _load("b", operand_scope),
                   "dietserve_wmma_fill_f32": _fill,
                   "dietserve_wmma_sync_f16f16f32": _sync,
                   f"dietserve_wmma_store_f32_{result}": lambda: _store(result_scope)}
    for name, define in definitions.items():
        if TensorIntrin.get(name, allow_missing=True) is None:
            TensorIntrin.register(name, *define())
    return dict(zip(("load_a", "load_b", "init", "compute", "store"), definitions, strict=True))
