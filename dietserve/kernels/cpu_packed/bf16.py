"""bf16 dense layers on AVX512-BF16: the weight as bf16 pairs, the activations rounded to bf16,
the products summed in fp32 (``vdpbf16ps``), the epilogue in fp32.

A pair is one 32-bit word holding two bf16 values of consecutive reduction steps, the even step
in the low half: ``Wb[N / panel, K / 2, panel]`` (``pack_array``). One ``vdpbf16ps`` multiplies
16 lanes of such words by a broadcast pair of one activation row and adds both products to 16
fp32 sums, so the packed kernel (``kernel.py``) runs unchanged over K / 2 pair steps with one
32-bit word where the fp32 kernel reads one float: its tiles, prefetches and task loops are the
same code.

TVM cannot pass ``<32 x bfloat>`` vectors to the intrinsic (its bf16 legalization rewrites them),
so the kernel calls a four-line LLVM function imported into its module (``pragma_import_llvm``)
that takes the pairs as ``<16 x i32>`` and bitcasts them; LLVM inlines it.

Rounding is to nearest, ties to even, as ``torch``'s and OpenVINO's conversions are. The
PrimFunc a bf16 kernel is applied to (``bf16_form``) states that arithmetic on its own, so every
kernel and its numpy check agree on what the layer computes.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..tir.rebuild import MatmulExpressions, reads, rebuild

PRECISION_ATTR = "dietserve.precision"  # "bf16" on a dense PrimFunc to be built with bf16 products
DOT_PAIRS = "dietserve_dpbf16ps"
ADJACENT_PAIRS = "dietserve_cvtne2ps2bf16"
# linkonce_odr: every kernel of a module imports them, and the copies merge. (The conversion's
# intrinsic puts its second operand's values first: the low half of each word is the even one.)
BF16_LLVM = f"""
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
define linkonce_odr <16 x float> @{DOT_PAIRS}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) #0 {{
  %x = bitcast <16 x i32> %a to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %x, <32 x bfloat> %y)
  ret <16 x float> %r
}}
declare <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float>, <16 x float>)
define linkonce_odr <16 x i32> @{ADJACENT_PAIRS}(<16 x float> %first, <16 x float> %second) #0 {{
  %r = call <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float> %second, <16 x float> %first)
  %w = bitcast <32 x bfloat> %r to <16 x i32>
  ret <16 x i32> %w
}}
attributes #0 = {{ alwaysinline nounwind "target-features"="+avx512f,+avx512bf16" }}
"""
PAIR_LANES = 16  # fp32 sums per vdpbf16ps (a 512-bit register)


def has_dot_pairs(target) -> bool:
    """Whether ``target`` (a tvm Target) is a CPU whose ISA has AVX512-BF16 (``vdpbf16ps``)."""
    from ...host.cpu import target_cpu_flags

    return target.kind.name == "llvm" and "avx512_bf16" in target_cpu_flags(target)


def check_bf16_target(target) -> None:
    """Raise ValueError unless ``target`` can run bf16 kernels (``has_dot_pairs``)."""
    if target.kind.name != "llvm":
        raise ValueError(f"bf16 kernels are built for CPUs (llvm targets), not {target.kind.name}")
    if not has_dot_pairs(target):
        mcpu = str(target.attrs["mcpu"]) if "mcpu" in target.attrs else "this CPU"
        raise ValueError(f"bf16 products need AVX512-BF16 (vdpbf16ps), which {mcpu} lacks: build with "
                         f"--precision fp32, or for a CPU that has it (e.g. --mcpu znver4, sapphirerapids)")


def precision_of(func: tirx.PrimFunc) -> str:
    return str(func.attrs[PRECISION_ATTR]) if func.attrs is not None and PRECISION_ATTR in func.attrs else "fp32"


# -- the arithmetic, in TIR ----------------------------------------------------------------

def _bits(value) -> tirx.Expr:
    """fp32 ``value`` rounded to bf16, as its 16 bits in the low half of a uint32."""
    u = tirx.reinterpret("uint32", value)
    return (u + tirx.const(0x7FFF, "uint32") + ((u >> tirx.const(16, "uint32")) & tirx.const(1, "uint32"))) \
        >> tirx.const(16, "uint32")


def rounded(value) -> tirx.Expr:
    """fp32 ``value`` rounded to the nearest bf16, as fp32."""
    return tirx.reinterpret("float32", _bits(value) << tirx.const(16, "uint32"))


def pair(even, odd) -> tirx.Expr:
    """Two fp32 values as one bf16 pair (``even`` in the low half)."""
    return _bits(even) | (_bits(odd) << tirx.const(16, "uint32"))


def half(word, odd) -> tirx.Expr:
    """The bf16 of a pair ``word`` at step parity ``odd`` (0 or 1), as fp32."""
    shift = tirx.Cast("uint32", odd) * tirx.const(16, "uint32")
    return tirx.reinterpret("float32", ((word >> shift) & tirx.const(0xFFFF, "uint32")) << tirx.const(16, "uint32"))


def dot_pairs(acc, activation_pair, weight_pairs) -> tirx.Expr:
    """``acc`` (16 fp32 lanes) plus, per lane, the two products of a broadcast activation pair
    and that lane's weight pair."""
    as_words = lambda value: tirx.reinterpret(f"int32x{PAIR_LANES}", value)  # noqa: E731
    return tirx.call_extern(f"float32x{PAIR_LANES}", DOT_PAIRS, acc,
                            as_words(tirx.Broadcast(activation_pair, PAIR_LANES)), as_words(weight_pairs))


def adjacent_pairs(first, second) -> tirx.Expr:
    """32 consecutive fp32 values, two 16-lane vectors, as the 16 bf16 pairs of neighbours
    (``pair(v[2k], v[2k + 1])`` for each k): one ``vcvtne2ps2bf16``, rounding as ``pair`` does."""
    return tirx.call_extern(f"uint32x{PAIR_LANES}", ADJACENT_PAIRS, first, second)


def importing_bf16_functions(body: tirx.Stmt) -> tirx.Stmt:
    """``body`` with the LLVM functions ``dot_pairs`` and ``adjacent_pairs`` call imported into
    its module."""
    return tirx.AttrStmt(tirx.const(0, "int32"), "pragma_import_llvm", tvm.ir.StringImm(BF16_LLVM), body)


# -- the PrimFunc ----------------------------------------------------------------------------

def bf16_form(func: tirx.PrimFunc, weight: tirx.Buffer) -> tirx.PrimFunc:
    """The packed dense layer ``func`` (reading ``weight`` as ``[N / panel, K, panel]`` fp32)
    reading bf16 pairs ``[N / panel, K / 2, panel]`` instead, its activations rounded to bf16:
    one matmul block and one epilogue block, the arithmetic a bf16 kernel performs."""
    op = MatmulExpressions(func)
    panels, depth, width = weight.shape
    if int(depth) % 2:
        raise ValueError(f"a bf16 weight pairs reduction steps: K={depth} is odd")
    pairs = tirx.decl_buffer((panels, tirx.const(int(depth) // 2, depth.ty.dtype), width), "uint32", weight.name)
    mul = op.product
    weight_side = reads(mul.b, weight)
    if weight_side == reads(mul.a, weight):
        raise ValueError("expected one side of the product to read the weight")
    x_side, w_side = (mul.a, mul.b) if weight_side else (mul.b, mul.a)
    params = [pairs if p.same_as(weight) else p for p in func.params]
    rows_panels_lanes, k = op.extents[:-1], op.extents[-1]
    with IRBuilder() as builder:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            for p in params:
                T.arg(p.name, p)
            T.func_attr(dict(func.attrs.items()))
            with T.sblock("root"):
                result = T.sblock_alloc_buffer(list(rows_panels_lanes), "float32")
                with T.grid(*rows_panels_lanes, k) as loops:
                    with T.sblock("matmul"):
                        i, p, lane = (T.axis.spatial(e, v) for e, v in zip(rows_panels_lanes, loops, strict=False))
                        r = T.axis.reduce(k, loops[-1])
                        names = dict(zip(op.iter_vars, (i, p, lane, r), strict=True))

                        def unpacked(load, p=p, lane=lane, r=r):
                            return half(pairs[p, r // 2, lane], r % 2)

                        product = rounded(rebuild(x_side, names)) * rebuild(w_side, names, {weight: unpacked})
                        with T.init():
                            T.buffer_store(result, tirx.const(0, "float32"), [i, p, lane])
                        T.buffer_store(result, result[i, p, lane] + product, [i, p, lane])
                out_extents = list(op.out.shape)
                with T.grid(*out_extents) as loops:
                    with T.sblock("epilogue"):
                        axes = [T.axis.spatial(e, v) for e, v in zip(out_extents, loops, strict=True)]
                        names = dict(zip(op.out_vars, axes, strict=True))
                        value = rebuild(op.epilogue, names, {op.result: lambda load: result[
                            tuple(rebuild(index, names) for index in load.indices)]})
                        T.buffer_store(op.out, value, axes)
    return builder.get()


def bf16_packing(k: int, n: int, panel: int) -> tirx.PrimFunc:
    """``W[K, N]`` fp32 -> its bf16 pairs ``[N / panel, K / 2, panel]``: what ``pack_array``
    does, as a PrimFunc the model runs once, when it loads its weights."""
    weight = te.placeholder((k, n), "float32", name="W")
    pairs = te.compute((n // panel, k // 2, panel), lambda jo, kp, ji: pair(
        weight[2 * kp, jo * panel + ji], weight[2 * kp + 1, jo * panel + ji]), name="pairs")
    return te.create_prim_func([weight, pairs], index_dtype_override="int64")


# -- the data ----------------------------------------------------------------------------------

def bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 ``values`` rounded to bf16 (nearest, ties to even), as uint16 bits."""
    u = np.ascontiguousarray(values, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_rounded(values: np.ndarray) -> np.ndarray:
    """fp32 ``values`` rounded to bf16, as fp32: what a bf16 kernel multiplies."""
    return (bf16_bits(values).astype(np.uint32) << 16).view(np.float32)


def pack_array(weight: np.ndarray, panel: int) -> np.ndarray:
    """``W[K, N]`` fp32 -> bf16 pairs ``[N / panel, K / 2, panel]`` (uint32, the even step low)."""
    k, n = weight.shape
    if n % panel or k % 2:
        raise ValueError(f"cannot pack a [{k}, {n}] weight into bf16 pairs of panels of {panel}")
    bits = bf16_bits(weight).astype(np.uint32)
    words = bits[0::2] | (bits[1::2] << 16)  # [K / 2, N]
    return np.ascontiguousarray(words.reshape(k // 2, n // panel, panel).transpose(1, 0, 2))
