"""CPU micro-kernels are correct for every shape (numpy is the reference), including primes
and T smaller than a tile, with local padding and with loop partitioning; the inner loop
carries no bound checks."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.apply import apply_kernel
from dietserve.kernels.decision_tree_func import dispatched_prim_func
from dietserve.kernels.plan.decision_tree import choose, interval_tree
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.cpu import cpu_space
from dietserve.kernels.tir.build import build
from tuner.ops import attention_context, attention_scores, dense, random_inputs

SHAPES = (1, 2, 7, 13, 64, 127, 128, 129, 300, 512)
TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def kernel(mr, ti, nr, tj, kc=1, pack_b=False) -> MicroKernel:
    return MicroKernel(tile=(("i", (mr, ti)), ("j", (nr, tj)), ("k", (kc,))), vector=8,
                       cache_scopes=("local", "B.local") if pack_b else ("local",))


KERNELS = {
    "1x1 tiles": kernel(1, 1, 8, 1),
    "6x16 per register tile, 4x2 of them": kernel(6, 4, 16, 2, kc=8, pack_b=True),
    "prime 5x3 rows, 24-wide": kernel(5, 3, 24, 1, kc=32),
}
OPERATORS = {
    "dense_bias_gelu": lambda: dense(768, 768, "bias_gelu"),
    "dense_bias_odd_n": lambda: dense(96, 200, "bias"),  # N not a multiple of the column tile
    "attention_scores": lambda: attention_scores(12, 64),
    "attention_context": lambda: attention_context(12, 64),
}


def run(lib, spec, length: int) -> tuple[np.ndarray, np.ndarray]:
    shape = {"T": length}
    inputs = random_inputs(spec, shape, seed=length)
    out = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"))
    lib(*[tvm.runtime.tensor(x) for x in inputs], out)
    return out.numpy(), spec.reference(*inputs)


@pytest.mark.parametrize("operator", sorted(OPERATORS))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_micro_kernel_matches_numpy_at_every_length(operator: str, name: str) -> None:
    spec = OPERATORS[operator]()
    lib = build(apply_kernel(spec.func, KERNELS[name], "llvm"), TARGET)
    for length in SHAPES:
        got, expected = run(lib, spec, length)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"{operator} T={length}")


@pytest.mark.parametrize("operator", ["dense_bias_gelu", "attention_context"])
def test_loop_partitioned_kernels_match_numpy(operator: str) -> None:
    spec = OPERATORS[operator]()
    scheduled = apply_kernel(spec.func, KERNELS["6x16 per register tile, 4x2 of them"], "llvm", loop_partition=True)
    assert "pragma_loop_partition_hint" in scheduled.script()
    lib = build(scheduled, TARGET)
    for length in SHAPES:
        got, expected = run(lib, spec, length)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"T={length}")


def update_block(script: str) -> str:
    """The scheduled reduction's update block: from its header to the next block."""
    start = script.index('T.sblock("matmul_update")')
    end = script.find("T.sblock(", start + 1)
    block = script[start:end if end > 0 else None]
    assert "matmul_pad_local_local" in block or "matmul_local" in block, block  # the register tile
    return block


@pytest.mark.parametrize("operator", sorted(OPERATORS))
def test_inner_loop_has_no_bound_checks(operator: str) -> None:
    spec = OPERATORS[operator]()
    script = apply_kernel(spec.func, KERNELS["prime 5x3 rows, 24-wide"], "llvm").script()
    block = update_block(script)
    assert "T.where" not in block and "if_then_else" not in block, block
    # The checks exist, outside: where operands are packed and results written back.
    assert "if_then_else" in script or "T.where" in script


def test_space_fits_the_register_file() -> None:
    for preset in ("avx2", "avx512"):
        hardware = CPU_PRESETS[preset]
        lanes = hardware.lanes()
        for k in cpu_space(hardware):
            mr, nr = k.tile_sizes("i")[0], k.tile_sizes("j")[0]
            assert nr % lanes == 0 and mr * (nr // lanes) + nr // lanes + 1 <= hardware.vector_registers
    assert len(cpu_space(CPU_PRESETS["avx512"])) > len(cpu_space(CPU_PRESETS["avx2"]))


def _plan(variants: dict, tree: dict) -> KernelPlan:
    axes = {"b": "1", "i": "T", "j": "64", "k": "128"}
    return KernelPlan(workload="w", operator="dense", shape_vars=["T"], axes=axes,
                      target={"kind": "llvm"}, tvm_version=tvm.__version__,
                      variants={name: k.to_dict() for name, k in variants.items()}, tree=tree,
                      tuned_range={"var": "T", "min": 1, "max": 512})


def test_dispatched_function_branches_to_each_variant() -> None:
    spec = dense(128, 64, "bias_gelu")
    small, large = KERNELS["1x1 tiles"], KERNELS["6x16 per register tile, 4x2 of them"]
    tree = interval_tree("T", [1, 8, 9, 512], ["small", "small", "large", "large"])
    assert tree == {"var": "T", "le": 8, "then": {"variant": "small"}, "else": {"variant": "large"}}
    plan = _plan({"small": small, "large": large}, tree)
    assert choose(plan.tree, {"T": 8}) == "small" and choose(plan.tree, {"T": 9}) == "large"
    lib = build(dispatched_prim_func(spec.func, plan, TARGET), TARGET)
    for length in (1, 8, 9, 13, 300):
        got, expected = run(lib, spec, length)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"T={length}")
    # One variant reached from two leaves (small, large, small again).
    plan = _plan({"small": small, "large": large},
                 interval_tree("T", [1, 8, 9, 100, 101, 512], ["small", "small", "large", "large", "small", "small"]))
    lib = build(dispatched_prim_func(spec.func, plan, TARGET), TARGET)
    for length in (1, 9, 100, 101, 300):
        got, expected = run(lib, spec, length)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"T={length}")


def test_every_length_of_a_small_operator_lands_on_a_correct_variant() -> None:
    """T = 1..300 through a three-variant tree plus the default rule's kernel, each answer
    against numpy: the boundaries (7|8, 40|41, 200|201) and the range past the last split."""
    spec = dense(32, 24, "bias_gelu")
    variants = {"a": KERNELS["1x1 tiles"], "b": KERNELS["prime 5x3 rows, 24-wide"],
                "c": KERNELS["6x16 per register tile, 4x2 of them"]}
    tree = interval_tree("T", [7, 40, 200, 256], ["a", "b", DEFAULT_VARIANT, "c"])
    plan = KernelPlan(workload="w", operator="dense", shape_vars=["T"], axes={"b": "1", "i": "T", "j": "24", "k": "32"},
                      target={"kind": "llvm"}, tvm_version=tvm.__version__,
                      variants={**{n: k.to_dict() for n, k in variants.items()}, DEFAULT_VARIANT: None}, tree=tree,
                      tuned_range={"var": "T", "min": 1, "max": 256})
    lib = build(dispatched_prim_func(spec.func, plan, TARGET), TARGET)
    for length in range(1, 301):
        got, expected = run(lib, spec, length)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"T={length}")
