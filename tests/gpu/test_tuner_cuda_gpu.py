"""On a GPU: CUDA micro-kernels applied with local padding compute BERT's operators exactly as
numpy does, for sequence lengths on and off the tile boundaries, from one compiled kernel each.

Skipped cleanly where tvm.cuda(0) finds no GPU (every CI machine)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from dietserve.host.hardware import GPU_PRESETS
from dietserve.kernels.cuda.kernel import apply_cuda
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.gpu import gpu_space, shared_memory_bytes
from tuner.ops import OperatorSpec, attention_context, attention_scores, dense, random_inputs

pytestmark = pytest.mark.gpu

LENGTHS = (1, 2, 7, 13, 64, 127, 128, 129, 300, 512)

OPERATORS = {
    "dense_bias_gelu": lambda: dense(768, 3072, "bias_gelu"),
    "dense_bias_ragged": lambda: dense(200, 100, "bias"),  # K and N off every tile boundary
    "attention_scores": attention_scores,
    "attention_context": attention_context,
}


def _gpu_arch() -> str:
    import tvm

    return "sm_" + str(tvm.cuda(0).compute_version).replace(".", "")


def _kernels() -> dict[str, MicroKernel]:
    h100, t4 = ([k for k in gpu_space(GPU_PRESETS[name]) if not k.mma] for name in ("h100", "t4"))
    return {
        "typical": MicroKernel(tile=(("i", (4, 8)), ("j", (4, 16)), ("k", (16,))), unroll=64, vector=4,
                               cache_scopes=("shared", "local")),
        "t4_largest_shared": max(t4, key=shared_memory_bytes),
        "h100_largest_shared": max(h100, key=shared_memory_bytes),  # dynamic shared memory
        "smallest_tile": min(t4, key=lambda k: (k.tile_of("i") * k.tile_of("j"), -k.vector, k.unroll)),
    }


@functools.cache
def _compiled(op: str, kernel_name: str, loop_partition: bool):
    import tvm
    from tvm.target import Target

    spec = OPERATORS[op]()
    scheduled = apply_cuda(spec.func, _kernels()[kernel_name], loop_partition=loop_partition)
    executable = tvm.compile(scheduled, Target({"kind": "cuda", "arch": _gpu_arch()}, host={"kind": "llvm"}))
    return spec, executable.jit()


def _run(spec: OperatorSpec, module, length: int) -> tuple[np.ndarray, np.ndarray]:
    import tvm

    device = tvm.cuda(0)
    shape = {"T": length}
    inputs = random_inputs(spec, shape, seed=length)
    output = tvm.runtime.tensor(np.full(spec.output_shape(shape), np.nan, "float32"), device)
    module["main"](*[tvm.runtime.tensor(array, device) for array in inputs], output)
    device.sync()
    return output.numpy(), spec.reference(*inputs)


@pytest.mark.parametrize("loop_partition", [False, True])
@pytest.mark.parametrize("kernel_name", list(_kernels()))
@pytest.mark.parametrize("op", list(OPERATORS))
def test_scheduled_kernel_matches_numpy_for_every_length(op: str, kernel_name: str, loop_partition: bool) -> None:
    if kernel_name.startswith("h100") and int(_gpu_arch()[3:]) < 90:
        pytest.skip("an H100 kernel: needs the shared memory of an sm_90 GPU")
    spec, module = _compiled(op, kernel_name, loop_partition)
    for length in LENGTHS:
        ours, expected = _run(spec, module, length)
        assert not np.isnan(ours).any(), f"T={length}: elements left unwritten"
        np.testing.assert_allclose(ours, expected, rtol=1e-3, atol=1e-3, err_msg=f"T={length}")


# -- tensor-core kernels (sm_80+): fp16 operands, fp32 accumulation ---------------------------

def _tensor_core_kernels() -> dict[str, MicroKernel]:
    from dietserve.kernels.space.gpu_tensor_core import registers_per_thread, tensor_core_kernel, tensor_core_space
    from dietserve.kernels.space.gpu_tensor_core import shared_memory_bytes as tc_shared

    space = tensor_core_space(GPU_PRESETS["a100"])
    return {"tc_typical": tensor_core_kernel(2, 2, 2, 2, 2), "tc_largest_shared": max(space, key=tc_shared),
            "tc_most_registers": max(space, key=registers_per_thread),
            "tc_one_warp": tensor_core_kernel(1, 1, 1, 1, 1)}


def fp16_reference(spec: OperatorSpec, inputs: list[np.ndarray]) -> np.ndarray:
    """The operator on its two product operands rounded to fp16, in fp32 (the other inputs, bias
    and residual, stay fp32 as the kernel reads them)."""
    rounded = [x.astype(np.float16).astype(np.float32) if i < 2 else x for i, x in enumerate(inputs)]
    return spec.reference(*rounded)


@functools.cache
def _compiled_tensor_core(op: str, kernel_name: str, pipeline: bool):
    import tvm
    from tvm.target import Target

    from dietserve.kernels.cuda.tensor_core import apply_tensor_core

    spec = OPERATORS[op]()
    scheduled = apply_tensor_core(spec.func, _tensor_core_kernels()[kernel_name], pipeline=pipeline)
    executable = tvm.compile(scheduled, Target({"kind": "cuda", "arch": _gpu_arch()}, host={"kind": "llvm"}))
    return spec, executable.jit()


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("kernel_name", ["tc_typical", "tc_largest_shared", "tc_most_registers", "tc_one_warp"])
@pytest.mark.parametrize("op", list(OPERATORS))
def test_tensor_core_kernel_matches_fp16_rounded_numpy(op: str, kernel_name: str, pipeline: bool) -> None:
    if int(_gpu_arch()[3:]) < 80:
        pytest.skip("tensor-core kernels are listed for sm_80 and later")
    import tvm

    spec, module = _compiled_tensor_core(op, kernel_name, pipeline)
    device = tvm.cuda(0)
    for length in LENGTHS:
        inputs = random_inputs(spec, {"T": length}, seed=length)
        output = tvm.runtime.tensor(np.full(spec.output_shape({"T": length}), np.nan, "float32"), device)
        module["main"](*[tvm.runtime.tensor(x, device) for x in inputs], output)
        device.sync()
        got = output.numpy()
        assert not np.isnan(got).any(), f"T={length}: elements left unwritten"
        np.testing.assert_allclose(got, fp16_reference(spec, inputs), rtol=0, atol=1e-2, err_msg=f"T={length}")
