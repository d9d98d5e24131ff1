"""The build machine's side of ``remote_check.py``: ``prepare`` writes the bundle a GPU host
runs (the runtime-only TVM package, MiniLM's weights rounded to fp16, the CUDA artifacts
without weights, the kernel bundle, the GPU benchmark's part, a local transformers reference).
What each holds: ``remote_check.py``'s docstring."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tarfile
import time
from pathlib import Path

import numpy as np

from tests.gpu.carried_artifacts import ARCH, MAX_BATCH, carry_artifact, cuda_core_split, hand_plans
from tests.gpu.kernel_bundle import KERNEL_CHECK_LENGTHS, build_kernels, tensor_core_kernels

REPO = Path(__file__).resolve().parents[2]
BATCHES = (1, 3, 8)  # the model stage's shapes (``remote_check.py``), and the local reference's
SEQS = (1, 7, 64, 127, 300, 512)
DENSE_TIMING_ROWS = (1, 16, 64, 128, 512, 2048, 4096)
SAMPLED_KERNELS = (6, 3)  # CUDA-core and tensor-core kernels of the H100's space timed on MiniLM's FFN
BUNDLE_LIMIT = 62 * 1024 * 1024


def _rounded_checkpoint(work: Path, bundle: Path) -> Path:
    """The default checkpoint with weights rounded to float16: float32 copy (compiled from, and
    the local reference) in ``work``, float16 copy in the bundle."""
    from safetensors.numpy import load_file, save_file

    from dietserve.model.presets import default_model_folder

    source = default_model_folder()
    folder = work / "minilm-f16-rounded"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("model.safetensors", "README.md", "data_config.json"))
    weights = load_file(str(source / "model.safetensors"))
    half = {name: tensor.astype(np.float16) if tensor.dtype == np.float32 else tensor
            for name, tensor in weights.items()}
    for name, tensor in half.items():
        if tensor.dtype == np.float16 and not np.isfinite(tensor).all():
            raise ValueError(f"{name} does not fit float16")
    save_file({n: t.astype(np.float32) if t.dtype == np.float16 else t for n, t in half.items()},
              str(folder / "model.safetensors"))
    (bundle / "model").mkdir(parents=True)
    save_file(half, str(bundle / "model" / "model.f16.safetensors"))
    shutil.copy(folder / "config.json", bundle / "model" / "config.json")
    return folder


def _kernel_cases(quick: bool) -> list[dict]:
    """(operator, kernel, loop partition, what to do) for the kernel bundle."""
    import random

    from dietserve.host.hardware import GPU_PRESETS
    from dietserve.kernels.plan.microkernel import MicroKernel
    from dietserve.kernels.space.gpu import gpu_space, shared_memory_bytes
    from dietserve.kernels.space.gpu_tensor_core import tensor_core_space
    from tuner.ops import attention_context, attention_scores, dense

    h100, t4 = ([k for k in gpu_space(GPU_PRESETS[name]) if not k.mma] for name in ("h100", "t4"))
    named = {  # the kernels of test_tuner_cuda_gpu.py
        "typical": MicroKernel(tile=(("i", (4, 8)), ("j", (4, 16)), ("k", (16,))), unroll=64, vector=4,
                               cache_scopes=("shared", "local")),
        "t4_largest_shared": max(t4, key=shared_memory_bytes),
        "h100_largest_shared": max(h100, key=shared_memory_bytes),  # dynamic shared memory
        "smallest_tile": min(t4, key=lambda k: (k.tile_of("i") * k.tile_of("j"), -k.vector, k.unroll)),
    }
    checked = {
        "dense_bias_gelu": lambda: dense(768, 3072, "bias_gelu"),
        "dense_bias_ragged": lambda: dense(200, 100, "bias"),
        "attention_scores": attention_scores,
        "attention_context": attention_context,
    }
    tensor_cores = tensor_core_kernels()
    named.update(tensor_cores)
    cases = []
    for op, build in checked.items():
        for name, kernel in named.items():
            for partition in (False, True):
                if quick and partition:
                    continue
                cases.append({"op": op, "spec": build, "kernel_name": name, "kernel": kernel,
                              "loop_partition": partition, "check": KERNEL_CHECK_LENGTHS, "time": ()})
    # MiniLM's FFN up-projection: the default rule, the named kernels and a sample of the space.
    minilm = lambda: dense(384, 1536, "bias_gelu")  # noqa: E731
    # (each model's dense layers are timed against cuBLAS in bench_gpu.py's table)
    sample = random.Random(0).sample([k for k in h100 if k.cache_scopes[0] == "shared"], SAMPLED_KERNELS[0])
    tc_sample = random.Random(0).sample(tensor_core_space(GPU_PRESETS["h100"]), SAMPLED_KERNELS[1])
    timed = [("default", None), *named.items(), *((f"h100_space_{i}", k) for i, k in enumerate(sample)),
             *((f"h100_tc_space_{i}", k) for i, k in enumerate(tc_sample))]
    for name, kernel in timed:
        cases.append({"op": "minilm_dense_bias_gelu", "spec": minilm, "kernel_name": name, "kernel": kernel,
                      "loop_partition": False, "check": (1, 7, 129, 512), "time": DENSE_TIMING_ROWS})
    return cases



def _runtime_package(bundle: Path) -> None:
    from dietserve.runtime.tvm_runtime_only import write_runtime_package

    write_runtime_package(bundle)  # tvm-runtime.tgz and whl/, as the tuner's bundles carry them


def _local_reference(bundle: Path, checkpoint: Path) -> None:
    """transformers on this machine for batch 1 at every length and batch 3 up to 127."""
    from tests.integration.reference import padded_batch, reference_hidden, reference_model

    model = reference_model(checkpoint)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    arrays = {}
    for batch, seq in [(1, s) for s in SEQS] + [(3, s) for s in SEQS if s <= 127]:
        ids, mask, types = padded_batch(np.random.default_rng(seq + batch), batch, seq, vocab)
        arrays[f"hidden_{batch}x{seq}"] = reference_hidden(model, ids, mask, types)
        arrays[f"ids_{batch}x{seq}"] = ids
    np.savez_compressed(bundle / "local_reference.npz", **arrays)


def prepare(bundle: Path, quick: bool, skip_bench: bool = False, bench_plans: Path | None = None) -> None:
    from dietserve.compile.artifact import CompileRequest, compile_artifact
    from dietserve.compile.target import TargetSpec

    started = time.perf_counter()
    bundle = bundle.resolve()
    work = REPO / "build" / "remote_check"
    shutil.rmtree(bundle, ignore_errors=True)
    bundle.mkdir(parents=True)
    work.mkdir(parents=True, exist_ok=True)
    print("rounding the default checkpoint to float16", flush=True)
    checkpoint = _rounded_checkpoint(work, bundle)
    cache = work / "cache"
    request = CompileRequest(model=str(checkpoint), target=TargetSpec(kind="cuda", arch=ARCH), max_batch=MAX_BATCH)
    print("compiling the CUDA artifact", flush=True)
    default = compile_artifact(request, cache, work / "artifact-default", progress=print)
    print("compiling the CUDA artifact with hand-made kernel plans", flush=True)
    plans = hand_plans(work / "plans", checkpoint, cache, cuda_core_split())
    tuned = compile_artifact(dataclasses.replace(request, plans=(plans,)), cache, work / "artifact-tuned",
                             progress=print)
    compiled = work / "compiled"  # artifacts, kernels, reference: carried as one .tgz
    shutil.rmtree(compiled, ignore_errors=True)
    for name, artifact in (("default", default), ("tuned", tuned)):
        carry_artifact(artifact, checkpoint, compiled / "artifacts" / name)
    print("compiling the kernel bundle", flush=True)
    build_kernels(compiled / "kernels", _kernel_cases(quick), ARCH)
    if not skip_bench:
        from tests.benchmarks.bench_gpu import prepare_bench

        print("the GPU benchmark's artifacts and kernels (tests/benchmarks/bench_gpu.py)", flush=True)
        prepare_bench(compiled / "bench", work, checkpoint, cache, quick, bench_plans)
    print("local transformers reference", flush=True)
    _local_reference(compiled, checkpoint)
    with tarfile.open(bundle / "compiled.tgz", "w:gz") as archive:
        for part in sorted(compiled.iterdir()):
            archive.add(part, arcname=part.name)
    print("packing the TVM runtime and the tvm-ffi wheel", flush=True)
    _runtime_package(bundle)
    total = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    for part in sorted(bundle.iterdir()):
        size = sum(p.stat().st_size for p in part.rglob("*") if p.is_file()) if part.is_dir() else part.stat().st_size
        print(f"  {part.name:28s} {size / 2**20:7.2f} MiB")
    print(f"bundle {bundle}: {total / 2**20:.1f} MiB in {time.perf_counter() - started:.0f} s")
    if total > BUNDLE_LIMIT:
        raise SystemExit(f"bundle is {total / 2**20:.1f} MiB, over the {BUNDLE_LIMIT / 2**20:.0f} MiB budget")


