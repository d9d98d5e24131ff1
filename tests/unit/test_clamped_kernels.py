"""Clamped-tile micro-kernels (attention's products, symbolic in both output axes): every kernel
of the space matches numpy at every length, the model's own fused scores operator (scale and
mask epilogue) matches TVM's unscheduled build of it, and the inner loop is straight FMA code
on registers with no bound checks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import tvm

from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.apply import apply_kernel
from dietserve.kernels.cpu_clamped.kernel import clamped_fits, is_clamped
from dietserve.kernels.cpu_clamped.settings import ClampedSettings
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.settings import KernelSettings
from dietserve.kernels.space import task_space
from dietserve.kernels.space.cpu import clamped_cpu_space, cpu_space, packed_cpu_space
from dietserve.kernels.tir.build import build
from tuner.extract import spec_from_prim_func
from tuner.ops import attention_context, attention_scores, dense, random_inputs

from .kernel_builds import build_each
from .test_packed_kernels import fma_loops

SHAPES = (1, 2, 7, 13, 64, 127, 128, 129, 300, 512)
TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
AVX2 = CPU_PRESETS["avx2"]


def _check_every_kernel(spec) -> None:
    kernels = task_space(cpu_space(AVX2) + packed_cpu_space(AVX2) + clamped_cpu_space(AVX2), spec.func)
    assert kernels and all(is_clamped(k) for k in kernels)
    functions = build_each(spec.func, kernels, TARGET)
    for length in SHAPES:
        shape = {"T": length}
        inputs = random_inputs(spec, shape, seed=length)
        expected = spec.reference(*inputs)
        arguments = [tvm.runtime.tensor(x) for x in inputs]
        for index, kernel in enumerate(kernels):
            out = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"))
            functions[index](*arguments, out)
            np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4, err_msg=f"{kernel} T={length}")


def test_every_clamped_kernel_matches_numpy_for_the_scores_product() -> None:
    _check_every_kernel(attention_scores(heads=2, head_dim=32))


def test_every_clamped_kernel_matches_numpy_for_the_context_product() -> None:
    # head_dim 40: column tiles of 16, 24 and 32 overlap at the edge; 48 is wider than the row
    spec = attention_context(heads=2, head_dim=40)
    assert not clamped_fits(spec.func, MicroKernel(tile=(("i", (1,)), ("j", (48,)), ("k", (1,))), vector=8,
                                                   cache_scopes=("clamped",)))
    _check_every_kernel(spec)


def test_clamped_space_follows_the_register_file() -> None:
    for hardware in CPU_PRESETS.values():
        for kernel in clamped_cpu_space(hardware):
            (mr, _), (nr,) = kernel.tile_sizes("i"), kernel.tile_sizes("j")
            vectors = nr // hardware.lanes()
            assert nr % hardware.lanes() == 0 and mr * vectors + vectors + 1 <= hardware.vector_registers
    assert len(clamped_cpu_space(CPU_PRESETS["avx512"])) > len(clamped_cpu_space(AVX2))
    # dense layers keep their packed kernels: clamping is for operators without a weight
    assert not any(is_clamped(k) for k in task_space(packed_cpu_space(AVX2) + clamped_cpu_space(AVX2),
                                                     dense(768, 768, "bias").func))


@pytest.fixture(scope="module")
def model_scores(legalized_minilm: tvm.IRModule):
    """The model's fused attention-scores PrimFunc: ``Q @ Kt * scale + mask``, 4-D, symbolic in
    batch and sequence length."""
    for gvar, func in legalized_minilm.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and "multiply" in gvar.name_hint and "matmul" in gvar.name_hint:
            if len(func.params) == 4 and len(func.params[0].ty.shape) == 4:
                return spec_from_prim_func(gvar.name_hint, func)
    raise AssertionError("no fused attention-scores PrimFunc in the model")


@pytest.mark.parametrize("tile", [(4, 24), (6, 16), (1, 8), (2, 32)])
def test_clamped_kernel_applies_the_models_scale_and_mask(model_scores, tile: tuple) -> None:
    spec = model_scores
    kernel = MicroKernel(tile=(("i", (tile[0],)), ("j", (tile[1],)), ("k", (1,))), vector=8,
                         cache_scopes=("clamped",))
    function = build(apply_kernel(spec.func, kernel, "llvm"), TARGET)["main"]
    rng = np.random.default_rng(0)
    for batch, length in ((1, 1), (2, 7), (1, 64), (3, 129), (1, 300)):
        shape = {"batch": batch, "seq_len": length}
        q, k, mask = (rng.uniform(-1, 1, s).astype("float32") for s in spec.input_shapes(shape))
        mask = np.where(mask > 0.5, -1e9, 0.0).astype("float32")  # some keys masked
        out = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"))
        function(*[tvm.runtime.tensor(x) for x in (q, k, mask)], out)
        expected = spec.expected(shape, [q, k, mask])
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-4, err_msg=f"{tile} {shape}")


def test_clamped_inner_loop_is_register_resident_fma_code() -> None:
    kernel = MicroKernel(tile=(("i", (4,)), ("j", (24,)), ("k", (1,))), vector=8, cache_scopes=("clamped",))
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})  # AVX2 + FMA
    asm = build(apply_kernel(attention_scores(12, 64).func, kernel, "llvm"), target).mod.inspect_source("asm")
    loops = fma_loops(asm)
    assert loops, "no FMA loop in the generated code"
    # Every FMA loop (the whole tile's and the narrower ones of the columns left): 4 FMAs per B
    # load (one per row), nothing spilled, no prefetch, no compare in the loop body but the
    # loop's own. The whole tile's: 4 rows x 3 vectors of accumulators, 12 FMAs per reduction
    # step from 3 B loads and 4 broadcasts.
    assert all(fmas == 4 * loads and stack == 0 and prefetches == 0
               for fmas, loads, _broadcasts, stack, prefetches in loops), loops
    assert any(fmas % 12 == 0 and fmas == 3 * broadcasts for fmas, _loads, broadcasts, _stack, _p in loops), loops


def test_columns_left_take_the_narrowest_tile_that_holds_them() -> None:
    """A 4 x 24 AVX2 tile (3 vectors): the columns left after the whole tiles run on a tile of
    1, 2 or 3 vectors ending at the last column (not always a whole tile started before them),
    each FMA-dense, and every remainder matches numpy."""
    kernel = MicroKernel(tile=(("i", (4,)), ("j", (24,)), ("k", (1,))), vector=8, cache_scopes=("clamped",))
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    spec = attention_scores(heads=2, head_dim=32)

    def loops_by_vectors(remainder_columns: bool) -> Counter:
        """How many FMA loops step each number of vectors (the tiles of shapes narrower than
        the tile included)."""
        settings = KernelSettings(clamped=ClampedSettings(remainder_columns=remainder_columns))
        asm = build(apply_kernel(spec.func, kernel, "llvm", settings=settings), target).mod.inspect_source("asm")
        loops = fma_loops(asm)
        assert all(fmas == 4 * loads and stack == 0 for fmas, loads, broadcasts, stack, _ in loops if broadcasts)
        return Counter(fmas // broadcasts for fmas, _loads, broadcasts, _stack, _p in loops if broadcasts)

    whole_tiles_only = loops_by_vectors(False)
    assert loops_by_vectors(True) - whole_tiles_only == Counter({1: 1, 2: 1}), whole_tiles_only
    function = build(apply_kernel(spec.func, kernel, "llvm"), target)["main"]
    for length in (24, 25, 32, 33, 40, 41, 47, 48, 49, 100):  # 0-23 columns left of whole 24s
        inputs = random_inputs(spec, {"T": length}, seed=length)
        out = tvm.runtime.tensor(np.full(spec.output_shape({"T": length}), np.nan, "float32"))
        function(*[tvm.runtime.tensor(x) for x in inputs], out)
        np.testing.assert_allclose(out.numpy(), spec.reference(*inputs), rtol=1e-4, atol=1e-4, err_msg=f"T={length}")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("variant", ["4x24x8", "6x16x1p", "1x8x32p", "default"])
def test_fused_softmax_matches_numpy_at_every_length(variant: str) -> None:
    """Scores and softmax as one kernel: inside a clamped kernel's tasks, or after any other."""
    from dietserve.kernels.apply import apply_variant

    spec = attention_scores(heads=2, head_dim=32)
    kernel = None
    if variant != "default":
        mr, nr, ti = (int(v) for v in variant.rstrip("p").split("x"))
        kernel = MicroKernel(tile=(("i", (mr, ti)), ("j", (nr,)), ("k", (1,))), vector=8,
                             cache_scopes=("clamped", "B.local") if variant.endswith("p") else ("clamped",))
    function = build(apply_variant(spec.func, kernel, TARGET, row_softmax=True), TARGET)["main"]
    for length in SHAPES:
        inputs = random_inputs(spec, {"T": length}, seed=length)
        out = tvm.runtime.tensor(np.full(spec.output_shape({"T": length}), np.nan, "float32"))
        function(*[tvm.runtime.tensor(x) for x in inputs], out)
        np.testing.assert_allclose(out.numpy(), _softmax(spec.reference(*inputs)), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{variant} T={length}")


def test_the_models_softmax_is_recognised_by_structure(legalized_minilm, model_scores) -> None:
    from dietserve.kernels.tir.row_softmax import is_last_axis_softmax

    found = {g.name_hint for g, f in legalized_minilm.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and is_last_axis_softmax(f)}
    assert len(found) == 1  # the attention softmax, whatever it is named; not the casts, sums or norms
    assert not is_last_axis_softmax(model_scores.func)


def test_every_clamped_kernel_compiles_and_matches_for_the_models_context_product(legalized_minilm) -> None:
    """The model's own 4-D context product (batch and heads as batch axes, head size 32 static):
    mr = 1 kernels once failed to build here (TVM folded a division by zero in a dead branch)."""
    from dietserve.kernels.cpu_packed.packing import weight_param
    from dietserve.kernels.tir.matching import is_dynamic_matmul

    found = [(g.name_hint, f) for g, f in legalized_minilm.functions_items() if is_dynamic_matmul(f)
             and weight_param(f) is None and len(f.params) == 3 and len(f.params[0].ty.shape) == 4]
    assert len(found) == 1, [name for name, _ in found]
    spec = spec_from_prim_func(*found[0])
    kernels = task_space(clamped_cpu_space(AVX2), spec.func)
    assert kernels and all(is_clamped(k) for k in kernels)
    functions = build_each(spec.func, kernels, TARGET)
    rng = np.random.default_rng(0)
    for batch, length in ((1, 1), (2, 7), (1, 129)):
        shape = {"batch": batch, "seq_len": length}
        inputs = [rng.uniform(-1, 1, s).astype("float32") for s in spec.input_shapes(shape)]
        expected = spec.expected(shape, inputs)
        for index, kernel in enumerate(kernels):
            out = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"))
            functions[index](*[tvm.runtime.tensor(x) for x in inputs], out)
            np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=f"{kernel} {shape}")
