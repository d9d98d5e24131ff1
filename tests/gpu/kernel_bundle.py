"""Single CUDA kernels carried to a GPU host: built here (TVM and nvcc), each with its fatbin and
an index of the shapes to check and time; there each is checked against numpy at ragged lengths
and timed beside torch (cuBLAS) in the same precision and with the same epilogue. Numpy only at
import: the GPU host has TVM's runtime alone.

An index entry: id, op (the group the table compares), kernel_name, kernel (a MicroKernel's dict;
None: the default rule), loop_partition, precision (``fp16``: the group's cuBLAS baseline runs in
fp16 too), check and time (row counts T), shapes (per T: inputs, output, flops), workload, kind,
epilogue, and source_sha256 or build_error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tests.benchmarks.timing import call_seconds

KERNEL_CHECK_LENGTHS = (1, 2, 7, 13, 64, 127, 128, 129, 300, 512)  # as test_tuner_cuda_gpu.py
TENSOR_CORE_TOLERANCE = 1e-2  # abs, against fp32 sums of fp16-rounded operands
INDEX_FILE = "index.json"


def tensor_core_kernels() -> dict:
    """The tensor-core kernels of test_tuner_cuda_gpu.py (fp16 operands: checked against numpy on
    fp16-rounded operands, within ``TENSOR_CORE_TOLERANCE``)."""
    from dietserve.host.hardware import GPU_PRESETS
    from dietserve.kernels.space.gpu_tensor_core import (
        registers_per_thread,
        shared_memory_bytes,
        tensor_core_kernel,
        tensor_core_space,
    )

    space = tensor_core_space(GPU_PRESETS["a100"])
    return {"tc_typical": tensor_core_kernel(2, 2, 2, 2, 2), "tc_largest_shared": max(space, key=shared_memory_bytes),
            "tc_most_registers": max(space, key=registers_per_thread), "tc_one_warp": tensor_core_kernel(1, 1, 1, 1, 1)}


def build_kernels(folder: Path, cases: list[dict], arch: str) -> None:
    """Each case (op, spec: a callable giving the OperatorSpec, kernel_name, kernel, loop_partition,
    check, time; optionally precision) compiled for ``arch`` into ``folder``, with the index."""
    import tvm
    from tvm.target import Target

    from dietserve.compile.cuda import compile_fatbin, source_digest
    from dietserve.kernels.apply import apply_default, apply_kernel
    from dietserve.kernels.cuda.source import find_cuda_source

    folder.mkdir(parents=True)
    target = Target({"kind": "cuda", "arch": arch}, host={"kind": "llvm", "mcpu": "x86-64"})
    index = []
    for number, case in enumerate(cases):
        spec = case["spec"]()
        entry = {key: case[key] for key in ("op", "kernel_name", "loop_partition", "check", "time")}
        entry.update(id=f"k{number:03d}", workload=spec.name, kind=spec.kind, epilogue=spec.epilogue,
                     precision=case.get("precision", "fp32"),
                     kernel=None if case["kernel"] is None else case["kernel"].to_dict())
        lengths = sorted(set(case["check"]) | set(case["time"]))
        entry["shapes"] = {str(t): {"inputs": [list(s) for s in spec.input_shapes({"T": t})],
                                    "output": list(spec.output_shape({"T": t})),
                                    "flops": spec.flops({"T": t})} for t in lengths}
        try:
            if case["kernel"] is None:
                scheduled = apply_default(spec.func, target)
            else:
                scheduled = apply_kernel(spec.func, case["kernel"], target, loop_partition=case["loop_partition"])
            executable = tvm.compile(scheduled, target)
            source = find_cuda_source(executable.mod)
            executable.export_library(str(folder / f"{entry['id']}.so"))
            (folder / f"{entry['id']}.fatbin").write_bytes(compile_fatbin(source, target))
            entry["source_sha256"] = source_digest(source)
        except Exception as err:  # noqa: BLE001 - a kernel that does not build is a result
            entry["build_error"] = f"{type(err).__name__}: {err}"[:1000]
        print(f"  kernel {entry['id']} {entry['op']} {entry['kernel_name']} lp={entry['loop_partition']}: "
              f"{entry.get('build_error', 'built')}", flush=True)
        index.append(entry)
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=1))


def median_ms(call, sync, repeats: int, warmup: int = 5) -> float:
    """Wall clock around each call and a device sync, median of ``repeats`` after warm-ups."""
    def synced() -> None:
        call()
        sync()

    return float(np.median(call_seconds(synced, runs=repeats, warmup=warmup)) * 1e3)


def events_seconds(call, number: int = 20, repeat: int = 5) -> float:
    """Seconds per call: CUDA events around ``number`` calls, median of ``repeat`` (as TVM's
    time_evaluator does it), after a warm-up."""
    import torch

    call()
    torch.cuda.synchronize()
    results = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            call()
        end.record()
        end.synchronize()
        results.append(start.elapsed_time(end) / 1e3 / number)
    return float(np.median(results))


def kernel_inputs(shapes: list, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)  # as tuner.ops.random_inputs
    return [rng.uniform(-1, 1, size).astype("float32") for size in shapes]


def kernel_reference(entry: dict, inputs: list[np.ndarray]) -> np.ndarray:
    if (entry.get("kernel") or {}).get("mma"):  # tensor cores: fp16 product operands, fp32 sums
        inputs = [x.astype(np.float16).astype(np.float32) if i < 2 else x for i, x in enumerate(inputs)]
    if entry["kind"] != "dense":
        return inputs[0] @ inputs[1]
    from scipy.special import erf

    y = inputs[0] @ inputs[1]
    if entry["epilogue"] != "none":
        y = y + inputs[2]
    if entry["epilogue"] == "bias_residual":
        y = y + inputs[3]
    if entry["epilogue"] == "bias_gelu":
        y = (0.5 * y * (1.0 + erf(y.astype(np.float64) / np.sqrt(2.0)))).astype(np.float32)
    return y


def torch_operator(entry: dict, inputs: list, precision: str):
    """The entry's operator in torch (cuBLAS), its tensors on the GPU in ``precision``."""
    import torch

    tensors = [torch.from_numpy(x).cuda().to(torch.float16 if precision == "fp16" else torch.float32) for x in inputs]
    if entry["kind"] != "dense" or entry["epilogue"] == "none":
        return lambda: tensors[0] @ tensors[1]
    x, w, b = tensors[:3]
    if entry["epilogue"] == "bias_gelu":
        return lambda: torch.nn.functional.gelu(torch.addmm(b, x, w))
    if entry["epilogue"] == "bias_residual":
        return lambda: torch.addmm(b, x, w).add_(tensors[3])
    return lambda: torch.addmm(b, x, w)


def _check_and_time_one(entry: dict, folder: Path, device) -> dict:
    import tvm

    from dietserve.runtime.cuda_kernels import install_prebuilt_kernels

    out = {}
    if "build_error" in entry:
        raise RuntimeError(f"did not build: {entry['build_error']}")
    install_prebuilt_kernels(folder / f"{entry['id']}.fatbin", entry["source_sha256"])
    module = tvm.runtime.load_module(str(folder / f"{entry['id']}.so"))
    errors = {}
    tolerance = (0.0, TENSOR_CORE_TOLERANCE) if (entry.get("kernel") or {}).get("mma") else (1e-3, 1e-3)
    for length in entry["check"]:
        shape = entry["shapes"][str(length)]
        inputs = kernel_inputs(shape["inputs"], seed=length)
        output = tvm.runtime.tensor(np.full(shape["output"], np.nan, "float32"), device)
        module["main"](*[tvm.runtime.tensor(x, device) for x in inputs], output)
        device.sync()
        got, expected = output.numpy(), kernel_reference(entry, inputs)
        if np.isnan(got).any():
            errors[length] = "NaN: elements left unwritten"
        elif not np.allclose(got, expected, rtol=tolerance[0], atol=tolerance[1]):
            errors[length] = f"max abs error {float(np.abs(got - expected).max()):.3g}"
    out["check_ok"] = not errors
    if errors:
        out["check_errors"] = errors
    timings = {}
    for rows in entry["time"]:
        shape = entry["shapes"][str(rows)]
        inputs = [tvm.runtime.tensor(x, device) for x in kernel_inputs(shape["inputs"], seed=rows)]
        output = tvm.runtime.tensor(np.empty(shape["output"], "float32"), device)
        timer = module.time_evaluator("main", device, number=20, repeat=5)
        module["main"](*inputs, output)
        seconds = float(np.median(timer(*inputs, output).results))
        timings[rows] = {"us": seconds * 1e6, "tflops": shape["flops"] / seconds / 1e12}
    if timings:
        out["timings"] = timings
    return out


def check_and_time(folder: Path, start: int, results: Path) -> None:
    """Check and time the kernels of ``folder`` from index ``start``, one JSON line each in
    ``results``; then torch for each timed op, in each precision its kernels are compared in.
    Quits after a CUDA error (the context is unusable): the caller goes on in a fresh process."""
    import torch
    import tvm

    torch.backends.cuda.matmul.allow_tf32 = False
    device = tvm.cuda(0)
    index = json.loads((folder / INDEX_FILE).read_text())
    for entry in index[start:]:
        out = {key: entry.get(key) for key in ("id", "op", "kernel_name", "loop_partition", "precision")}
        with open(results, "a") as handle:  # a marker: if this process dies, the parent knows where
            handle.write(json.dumps({**out, "started": True}) + "\n")
        try:
            out.update(_check_and_time_one(entry, folder, device))
        except Exception as err:  # noqa: BLE001
            out["error"] = f"{type(err).__name__}: {err}"[:1500]
        print(f"  {json.dumps(out)}", flush=True)
        with open(results, "a") as handle:
            handle.write(json.dumps(out) + "\n")
        if "cuda" in out.get("error", "").lower():
            os._exit(3)
    for op in dict.fromkeys(entry["op"] for entry in index if entry["time"]):
        group = [entry for entry in index if entry["op"] == op]
        timed = next(entry for entry in group if entry["time"])
        for precision in sorted({"fp32"} | {entry.get("precision", "fp32") for entry in group}):
            torch_times = {}
            for rows in timed["time"]:
                shape = timed["shapes"][str(rows)]
                seconds = events_seconds(torch_operator(timed, kernel_inputs(shape["inputs"], seed=rows), precision))
                torch_times[rows] = {"us": seconds * 1e6, "tflops": shape["flops"] / seconds / 1e12}
            with open(results, "a") as handle:
                handle.write(json.dumps({"id": f"torch-{op}-{precision}", "op": op, "precision": precision,
                                         "kernel_name": f"torch {precision} ({timed['epilogue']})",
                                         "timings": torch_times,
                                         "note": "CUDA events around 20 calls, median of 5 (as time_evaluator)"})
                             + "\n")
