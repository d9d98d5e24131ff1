"""Run the CUDA paths on a GPU host that has no TVM compiler and no TVM at all.

Two entry points:

    prepare  (here, the build machine: .venv, nvcc)
        .venv/bin/python tests/gpu/remote_check.py prepare [--bundle .gpu_carry] [--quick]
    run      (the GPU host: python3 with torch + transformers, TVM neither installed nor needed)
        python3 tests/gpu/remote_check.py run [--bundle .gpu_carry] [--out DIR]

``prepare`` writes a bundle (< 64 MiB; keep its folder ignored by git, e.g. ``/.gpu_carry/`` in
``.git/info/exclude``):

* ``tvm-runtime.tgz``: the installed ``tvm`` package without ``libtvm_compiler.so``, ``src/``,
  ``include/``, ``3rdparty/``; ``whl/``: the cp312 ``apache-tvm-ffi==0.1.14.post0`` wheel.
* ``model/``: the default checkpoint (all-MiniLM-L6-v2) with every weight rounded to float16 and
  stored so (45 MB instead of 91 MB: fp32 weights do not fit the 64 MiB a call may carry). The
  artifacts are compiled from the same rounded weights (as float32), so what runs on the GPU is
  compared with transformers on identical weights; ``run`` rebuilds each artifact's
  ``params.safetensors`` from them and checks it against the manifest's sha256.
* ``artifacts/default``: ``dietserve compile --target cuda --arch sm_90 --max-batch 8`` (dlight
  schedules); ``artifacts/tuned``: the same with hand-made CUDA kernel plans linked in (two
  micro-kernels and the default rule, split by row count, for every dense and attention matmul).
* ``kernels/``: CUDA micro-kernels applied with local padding (``dietserve.kernels.cuda.kernel``,
  tensor-core ones ``cuda.tensor_core``), each exported with its fatbin: the cases of
  ``test_tuner_cuda_gpu.py`` (checked at ragged lengths) and candidates for MiniLM's 384->1536
  dense+GELU timed against the default rule and torch.
* ``local_reference.npz``: transformers on this machine for a few shapes, to check the GPU
  host's own reference (transformers on its CPU) against.

``run`` installs the wheel and the runtime package under /tmp, re-executes itself with
``TVM_USE_RUNTIME_LIB=1``, then, each stage in a child process (a crashing kernel costs only its
stage), checks both artifacts against transformers (max abs error, bar 1e-4) for batch 1/3/8 x
seq 1..512, times the model against PyTorch on the same GPU, and checks/times the kernels.
Results: ``OUT/results.json`` and a summary on stdout. Errors are given over all positions (as
tests/gpu/test_cuda_numerics.py compares them) and over real, unpadded ones: the outputs at padded
positions (never used) deviate more, on CPU artifacts too (H100, 2026-11: real <= 6e-6, padded up
to 2.6e-4 at batch 8 x seq 512; the CPU artifact: 8.7e-6 and 1.2e-4 on the same inputs).

With the device tool: ``run(command="set -o pipefail; python3 tests/gpu/remote_check.py run
--out $OUT 2>&1 | tee $OUT/log.txt", carry=[".gpu_carry"])``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
ARCH = "sm_90"
MAX_BATCH = 8
TOLERANCE = 1e-4
BATCHES = (1, 3, 8)
SEQS = (1, 7, 64, 127, 300, 512)
TIMING_SEQS = (1, 8, 16, 32, 64, 128, 256, 384, 512)
KERNEL_CHECK_LENGTHS = (1, 2, 7, 13, 64, 127, 128, 129, 300, 512)  # as test_tuner_cuda_gpu.py
DENSE_TIMING_ROWS = (1, 16, 64, 128, 512, 2048, 4096)
TENSOR_CORE_TOLERANCE = 1e-2  # abs, against fp32 sums of fp16-rounded operands
BUNDLE_LIMIT = 62 * 1024 * 1024
PARAMS_FILE = "params.safetensors"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# prepare (build machine)
# ----------------------------------------------------------------------------------------------

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


def _param_map(artifact: Path, checkpoint: Path) -> list[list]:
    """[artifact param name, [checkpoint tensor names], transposed] for every artifact parameter:
    the tensors, each transposed if so, side by side along the last axis make the parameter (the
    fused QKV layer stacks the query, key and value projections). Built from the model's own
    source map and checked against the artifact's parameters, bit for bit."""
    from safetensors.numpy import load_file

    from dietserve.model.bert import BertModel, checkpoint_parts, transposed_weight_names
    from dietserve.model.checkpoint import Checkpoint, canonical_name
    from dietserve.runtime.manifest import Manifest

    ours = load_file(str(artifact / PARAMS_FILE))
    theirs = load_file(str(checkpoint / "model.safetensors"))
    opened = Checkpoint.open(checkpoint)
    model = BertModel(opened.config, opened.pooling)
    sources, transposed = checkpoint_parts(model), transposed_weight_names(model)
    raw_key = {canonical_name(key): key for key in theirs}
    mapping = []
    for name, _shape in Manifest.read(artifact).parameters:
        keys = [raw_key[part] for part in sources[name]]
        if not np.array_equal(_assemble(theirs, keys, name in transposed), ours[name]):
            raise ValueError(f"artifact parameter {name} is not {keys} side by side")
        mapping.append([name, keys, name in transposed])
    return mapping


def _assemble(tensors: dict, keys: list[str], transposed: bool) -> np.ndarray:
    from dietserve.model.side_by_side import side_by_side  # (numpy only: the GPU host imports it too)

    return side_by_side([tensors[key] for key in keys], transposed)


def _copy_artifact(artifact: Path, destination: Path) -> None:
    shutil.copytree(artifact, destination, ignore=shutil.ignore_patterns(PARAMS_FILE))


def _cuda_plans(folder: Path, checkpoint: Path, cache: Path) -> Path:
    """Hand-made CUDA plans for the model's dense and attention operators: two micro-kernels and
    the default rule, split by row count (as tests/integration/test_tuned_model.py does on CPU)."""
    import tvm

    from dietserve.compile.artifact import CompileRequest
    from dietserve.compile.target import TargetSpec
    from dietserve.compile.tuning import tuning_tasks
    from dietserve.kernels.plan.decision_tree import interval_tree
    from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan, plan_path
    from dietserve.kernels.plan.microkernel import MicroKernel
    from dietserve.kernels.tir.matching import matmul_axes

    def cuda(tm, ty, tn, tx, bk, vector=4, unroll=64):
        return MicroKernel(tile=(("i", (tm, ty)), ("j", (tn, tx)), ("k", (bk,))), unroll=unroll, vector=vector,
                           cache_scopes=("shared", "local")).to_dict()

    # The fastest of the bundle's kernels for MiniLM's 384->1536 dense on an H100 (first run,
    # 2026-11): "narrow" up to 128 rows, "typical" above. Plus the default rule for 9..16 rows,
    # so that one operator mixes dlight's kernel and micro-kernels.
    variants = {"narrow": cuda(4, 2, 2, 16, 32, vector=4, unroll=0), "typical": cuda(4, 8, 4, 16, 16),
                DEFAULT_VARIANT: None}
    splits = [(8, "narrow"), (16, DEFAULT_VARIANT), (128, "narrow"), (4096, "typical")]
    request = CompileRequest(model=str(checkpoint), target=TargetSpec(kind="cuda", arch=ARCH), max_batch=MAX_BATCH)
    tasks = tuning_tasks(request, cache)
    shutil.rmtree(folder, ignore_errors=True)
    for task in tasks.tasks:
        if task.vary["var"] != "seq_len":
            # The pooling sum (rows = batch, reduced over seq_len) is no [i,k]x[k,j] product: its
            # staged operand tile spans i, k and j, and these tiles overflow 48 KiB of shared
            # memory there (ptxas refuses). The tuner would drop such candidates; we leave it out.
            continue
        axes = matmul_axes(tvm.ir.load_json(task.func))
        plan = KernelPlan(workload=task.workload, operator=task.operator, shape_vars=["batch", "seq_len"], axes=axes,
                          target=tasks.target, tvm_version=str(tvm.__version__), variants=variants,
                          tree=interval_tree(axes["i"], [v for v, _ in splits], [n for _, n in splits]),
                          tuned_range={"var": axes["i"], "min": 1, "max": 4096},
                          provenance={"model": {"name": "remote_check hand-made CUDA plan"}})
        plan.write(plan_path(folder, task.workload))
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
    tensor_cores = _tensor_core_kernels()
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
    sample = random.Random(0).sample([k for k in h100 if k.cache_scopes[0] == "shared"], 6 if quick else 40)
    tc_sample = random.Random(0).sample(tensor_core_space(GPU_PRESETS["h100"]), 3 if quick else 12)
    timed = [("default", None), *named.items(), *((f"h100_space_{i}", k) for i, k in enumerate(sample)),
             *((f"h100_tc_space_{i}", k) for i, k in enumerate(tc_sample))]
    for name, kernel in timed:
        cases.append({"op": "minilm_dense_bias_gelu", "spec": minilm, "kernel_name": name, "kernel": kernel,
                      "loop_partition": False, "check": (1, 7, 129, 512), "time": DENSE_TIMING_ROWS})
    return cases


def _tensor_core_kernels() -> dict:
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


def _build_kernels(folder: Path, quick: bool) -> None:
    import tvm
    from tvm.target import Target

    from dietserve.compile.cuda import compile_fatbin, source_digest
    from dietserve.kernels.apply import apply_default, apply_kernel
    from dietserve.kernels.cuda.source import find_cuda_source

    folder.mkdir(parents=True)
    target = Target({"kind": "cuda", "arch": ARCH}, host={"kind": "llvm", "mcpu": "x86-64"})
    index = []
    for number, case in enumerate(_kernel_cases(quick)):
        spec = case["spec"]()
        entry = {key: case[key] for key in ("op", "kernel_name", "loop_partition", "check", "time")}
        entry.update(id=f"k{number:03d}", workload=spec.name, kind=spec.kind, epilogue=spec.epilogue,
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
    (folder / "index.json").write_text(json.dumps(index, indent=1))


def _runtime_package(bundle: Path) -> None:
    from dietserve.runtime.tvm_runtime_only import write_runtime_package

    write_runtime_package(bundle)  # tvm-runtime.tgz and whl/, as the tuner's bundles carry them


def _local_reference(bundle: Path, checkpoint: Path) -> None:
    """transformers on this machine for batch 1 at every length and batch 3 up to 127."""
    sys.path.insert(0, str(REPO))
    from tests.integration.reference import padded_batch, reference_hidden, reference_model

    model = reference_model(checkpoint)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    arrays = {}
    for batch, seq in [(1, s) for s in SEQS] + [(3, s) for s in SEQS if s <= 127]:
        ids, mask, types = padded_batch(np.random.default_rng(seq + batch), batch, seq, vocab)
        arrays[f"hidden_{batch}x{seq}"] = reference_hidden(model, ids, mask, types)
        arrays[f"ids_{batch}x{seq}"] = ids
    np.savez_compressed(bundle / "local_reference.npz", **arrays)


def prepare(bundle: Path, quick: bool) -> None:
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
    plans = _cuda_plans(work / "plans", checkpoint, cache)
    tuned = compile_artifact(dataclasses.replace(request, plans=(plans,)), cache, work / "artifact-tuned",
                             progress=print)
    compiled = work / "compiled"  # artifacts, kernels, reference: carried as one .tgz
    shutil.rmtree(compiled, ignore_errors=True)
    for name, artifact in (("default", default), ("tuned", tuned)):
        _copy_artifact(artifact, compiled / "artifacts" / name)
        (compiled / "artifacts" / name / "param_map.json").write_text(json.dumps(_param_map(artifact, checkpoint)))
    print("compiling the kernel bundle", flush=True)
    _build_kernels(compiled / "kernels", quick)
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


# ----------------------------------------------------------------------------------------------
# run (GPU host)
# ----------------------------------------------------------------------------------------------

def _bootstrap(bundle: Path) -> None:
    """Install the runtime under /tmp/dietserve-rt and re-execute with it (once)."""
    if os.environ.get("REMOTE_CHECK_READY") == "1":
        return
    sys.path.insert(0, str(REPO))
    from tuner.measure.bundle_device import install_runtime

    runtime_env = install_runtime(bundle, Path("/tmp/dietserve-rt"))
    expanded = Path("/tmp/dietserve-remote-check/bundle")
    shutil.rmtree(expanded.parent, ignore_errors=True)
    expanded.mkdir(parents=True)
    with tarfile.open(bundle / "compiled.tgz") as archive:
        archive.extractall(expanded, filter="data")
    (expanded / "model").symlink_to(bundle / "model")
    env = dict(runtime_env, REMOTE_CHECK_READY="1", REMOTE_CHECK_BUNDLE=str(expanded),
               PYTHONPATH=os.pathsep.join([runtime_env["PYTHONPATH"], str(REPO)]))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _cuda_runtime() -> dict:
    """Import the runtime-only TVM and make its CUDA device API available.

    With TVM_USE_RUNTIME_LIB=1, ``import tvm`` skips the backend autoload that loads
    ``libtvm_runtime_cuda.so``, so ``tvm.cuda(0)`` does not exist until it is loaded here."""
    import tvm
    from tvm_ffi.libinfo import load_lib_ctypes

    info = {"tvm": str(tvm.__version__), "runtime_only": bool(tvm.base._RUNTIME_ONLY),
            "cuda_exists_at_import": bool(tvm.cuda(0).exist)}
    if not info["cuda_exists_at_import"]:
        lib = Path(tvm.base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent
        tvm.base._LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes("tvm", "tvm_runtime_cuda", "RTLD_LOCAL",
                                                                    extra_lib_paths=[lib])
    info["cuda_exists"] = bool(tvm.cuda(0).exist)
    if info["cuda_exists"]:
        device = tvm.cuda(0)
        info.update(device_name=str(device.device_name), compute_version=str(device.compute_version))
    return info


def _materialize(bundle: Path, work: Path) -> dict:
    """float32 checkpoint for transformers and each artifact's params.safetensors, from float16."""
    from safetensors.numpy import load_file, save_file

    from dietserve.runtime.manifest import Manifest

    checkpoint = work / "checkpoint"
    if not (checkpoint / "model.safetensors").exists():
        checkpoint.mkdir(parents=True, exist_ok=True)
        half = load_file(str(bundle / "model" / "model.f16.safetensors"))
        full = {n: t.astype(np.float32) if t.dtype == np.float16 else t for n, t in half.items()}
        save_file(full, str(checkpoint / "model.safetensors"))
        shutil.copy(bundle / "model" / "config.json", checkpoint / "config.json")
    full = load_file(str(checkpoint / "model.safetensors"))
    report = {}
    for source in sorted((bundle / "artifacts").iterdir()):
        target = work / "artifacts" / source.name
        if not (target / PARAMS_FILE).exists():
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target)
            mapping = json.loads((source / "param_map.json").read_text())
            params = {name: _assemble(full, keys, transposed) for name, keys, transposed in mapping}
            save_file(params, str(target / PARAMS_FILE))
        expected = Manifest.read(target).files[PARAMS_FILE]
        report[source.name] = {"params_sha256_matches_manifest": sha256_file(target / PARAMS_FILE) == expected}
    return {"checkpoint": str(checkpoint), "artifacts": report}


def _stage_env(bundle: Path, work: Path) -> dict:
    import platform

    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name(0),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        info["nvidia_smi"] = str(err)
    info.update(_cuda_runtime())
    info.update(_materialize(bundle, work))
    return info


def _reference_model(work: Path):
    import torch
    from transformers import BertModel

    torch.set_num_threads(min(16, os.cpu_count() or 1))
    return BertModel.from_pretrained(str(work / "checkpoint"), attn_implementation="eager",
                                     dtype=torch.float32).eval()


def _stage_model(bundle: Path, work: Path, name: str) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.integration.reference import padded_batch, reference_hidden

    _cuda_runtime()
    from dietserve.runtime.artifact import load_artifact
    from dietserve.runtime.engine import Engine
    from dietserve.runtime.manifest import Manifest

    directory = work / "artifacts" / name
    verify = sha256_file(directory / PARAMS_FILE) == Manifest.read(directory).files[PARAMS_FILE]
    started = time.perf_counter()
    engine = Engine(load_artifact(directory, verify_hashes=verify))
    result = {"load_s": time.perf_counter() - started, "verified_hashes": verify, "shapes": {}}
    reference = _reference_model(work)
    local = np.load(bundle / "local_reference.npz")
    for batch in BATCHES:
        for seq in SEQS:
            key = f"{batch}x{seq}"
            entry = result["shapes"][key] = {}
            try:
                ids, mask, types = padded_batch(np.random.default_rng(seq + batch), batch, seq, engine.vocab_size)
                expected = reference_hidden(reference, ids, mask, types)
                out = engine.run(ids, mask, types)
                error = np.abs(out.last_hidden_state - expected)
                entry["max_abs_err"] = float(error.max())
                valid = mask.astype(bool)  # padded positions' outputs are never used, but compared
                entry["valid_max_abs_err"] = float(error[valid].max())
                entry["padded_max_abs_err"] = float(error[~valid].max()) if (~valid).any() else None
                np.save(work / f"hidden_{name}_{key}.npy", out.last_hidden_state)
                if name != "default" and (work / f"hidden_default_{key}.npy").exists():
                    other = np.load(work / f"hidden_default_{key}.npy")
                    entry["vs_default_max_abs"] = float(np.abs(out.last_hidden_state - other).max())
                weights = mask[..., None].astype(np.float64)
                pooled = (expected * weights).sum(1) / weights.sum(1)
                if engine.artifact.manifest.normalize_embeddings:
                    pooled = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
                entry["embedding_max_abs_err"] = float(np.abs(out.sentence_embedding - pooled).max())
                entry["ok"] = entry["max_abs_err"] <= TOLERANCE
                if f"hidden_{key}" in local.files:
                    assert np.array_equal(local[f"ids_{key}"], ids), "inputs differ from the build machine's"
                    entry["host_ref_vs_build_ref"] = float(np.abs(local[f"hidden_{key}"] - expected).max())
            except Exception as err:  # noqa: BLE001
                entry["error"] = f"{type(err).__name__}: {err}"[:1000]
            print(f"  [{name}] {key}: {entry}", flush=True)
    return result


def _median_ms(call, sync, repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        call()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def _stage_timing(bundle: Path, work: Path) -> dict:
    import torch
    from transformers import BertModel

    _cuda_runtime()
    import tvm

    from dietserve.runtime.artifact import load_artifact
    from dietserve.runtime.engine import Engine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = tvm.cuda(0)
    engines, errors = {}, {}
    for name in ("default", "tuned"):
        try:
            engines[name] = Engine(load_artifact(work / "artifacts" / name, verify_hashes=False))
        except Exception as err:  # noqa: BLE001 - the other one may still run
            errors[name] = f"{type(err).__name__}: {err}"[:1000]
    models = {impl: BertModel.from_pretrained(str(work / "checkpoint"), attn_implementation=impl,
                                              dtype=torch.float32).eval().cuda() for impl in ("sdpa", "eager")}
    rows = []
    rng = np.random.default_rng(0)
    for seq in TIMING_SEQS:
        ids = rng.integers(1000, 30000, (1, seq)).astype(np.int64)
        mask, types = np.ones_like(ids), np.zeros_like(ids)
        row = {"seq": seq}
        repeats = 50
        for name, engine in list(engines.items()):
            positions = np.arange(seq, dtype=np.int64)
            inputs = [tvm.runtime.tensor(a, device) for a in (ids, mask, types, positions)]
            forward, params = engine.artifact.vm["forward"], engine.artifact.params
            try:
                row[f"tvm_{name}_ms"] = _median_ms(lambda f=forward, i=inputs, p=params: f(*i, *p), device.sync,
                                                   repeats)
                row[f"tvm_{name}_e2e_ms"] = _median_ms(lambda e=engine, a=(ids, mask, types): e.run(*a),
                                                       device.sync, repeats)
            except Exception as err:  # noqa: BLE001
                errors[f"{name}@{seq}"] = f"{type(err).__name__}: {err}"[:1000]
                del engines[name]
        tensors = [torch.from_numpy(a).cuda() for a in (ids, mask, types)]
        for impl, model in models.items():
            with torch.inference_mode():
                row[f"torch_{impl}_ms"] = _median_ms(
                    lambda m=model, t=tensors: m(input_ids=t[0], attention_mask=t[1], token_type_ids=t[2]),
                    torch.cuda.synchronize, repeats)
        for name in engines:  # above 1: TVM is faster
            for impl in models:
                row[f"torch_{impl}_over_tvm_{name}"] = row[f"torch_{impl}_ms"] / row[f"tvm_{name}_ms"]
        print("  " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        rows.append(row)
    return {"method": "wall clock + device sync, median of 50 after 5 warm-ups; batch 1; inputs on the GPU "
                      "(e2e: Engine.run from numpy to numpy); torch fp32, TF32 off", "rows": rows, "errors": errors}


def _events_seconds(call, number: int = 20, repeat: int = 5) -> float:
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


def _kernel_inputs(shapes: list, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)  # as tuner.ops.random_inputs
    return [rng.uniform(-1, 1, size).astype("float32") for size in shapes]


def _kernel_reference(entry: dict, inputs: list[np.ndarray]) -> np.ndarray:
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


def _stage_kernels(bundle: Path, work: Path, start: int, results: Path) -> dict:
    """Check and time kernels from index ``start``; one JSON line per kernel in ``results``."""
    import torch

    _cuda_runtime()
    import tvm

    from dietserve.runtime.cuda_kernels import install_prebuilt_kernels

    torch.backends.cuda.matmul.allow_tf32 = False
    device = tvm.cuda(0)
    index = json.loads((bundle / "kernels" / "index.json").read_text())
    for entry in index[start:]:
        out = {"id": entry["id"], "op": entry["op"], "kernel_name": entry["kernel_name"],
               "loop_partition": entry["loop_partition"]}
        with open(results, "a") as handle:  # a marker: if this process dies, the parent knows where
            handle.write(json.dumps({**out, "started": True}) + "\n")
        try:
            if "build_error" in entry:
                raise RuntimeError(f"did not build: {entry['build_error']}")
            install_prebuilt_kernels(bundle / "kernels" / f"{entry['id']}.fatbin", entry["source_sha256"])
            module = tvm.runtime.load_module(str(bundle / "kernels" / f"{entry['id']}.so"))
            errors = {}
            tolerance = (0.0, TENSOR_CORE_TOLERANCE) if (entry.get("kernel") or {}).get("mma") else (1e-3, 1e-3)
            for length in entry["check"]:
                shape = entry["shapes"][str(length)]
                inputs = _kernel_inputs(shape["inputs"], seed=length)
                output = tvm.runtime.tensor(np.full(shape["output"], np.nan, "float32"), device)
                module["main"](*[tvm.runtime.tensor(x, device) for x in inputs], output)
                device.sync()
                got, expected = output.numpy(), _kernel_reference(entry, inputs)
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
                inputs = [tvm.runtime.tensor(x, device) for x in _kernel_inputs(shape["inputs"], seed=rows)]
                output = tvm.runtime.tensor(np.empty(shape["output"], "float32"), device)
                timer = module.time_evaluator("main", device, number=20, repeat=5)
                module["main"](*inputs, output)
                seconds = float(np.median(timer(*inputs, output).results))
                timings[rows] = {"us": seconds * 1e6, "tflops": shape["flops"] / seconds / 1e12}
            if timings:
                out["timings"] = timings
        except Exception as err:  # noqa: BLE001
            out["error"] = f"{type(err).__name__}: {err}"[:1500]
        print(f"  {json.dumps(out)}", flush=True)
        with open(results, "a") as handle:
            handle.write(json.dumps(out) + "\n")
        if "CUDA" in out.get("error", "") or "cuda" in out.get("error", ""):
            os._exit(3)  # the context may be poisoned: the parent goes on in a fresh process
    if any(entry["time"] for entry in index):  # torch for the timed operator, same shapes
        timed = next(entry for entry in index if entry["time"])
        torch_times = {}
        for rows in timed["time"]:
            shape = timed["shapes"][str(rows)]
            x, w, b = [torch.from_numpy(a).cuda() for a in _kernel_inputs(shape["inputs"], seed=rows)]
            seconds = _events_seconds(lambda a=(b, x, w): torch.nn.functional.gelu(torch.addmm(*a)))
            torch_times[rows] = {"us": seconds * 1e6, "tflops": shape["flops"] / seconds / 1e12}
        with open(results, "a") as handle:
            handle.write(json.dumps({"id": "torch", "op": timed["op"], "kernel_name": "torch addmm+gelu",
                                     "timings": torch_times,
                                     "note": "CUDA events around 20 calls, median of 5 (as time_evaluator)"}) + "\n")
    return {}


def _run_stage(stage: str, args: argparse.Namespace, extra: list[str], timeout: float) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "stage", stage, "--bundle", str(args.bundle),
               "--out", str(args.out), *extra]
    started = time.perf_counter()
    try:
        completed = subprocess.run(command, timeout=timeout)
        code = completed.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    path = args.out / f"{stage}.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result["exit"] = code
    result["seconds"] = time.perf_counter() - started
    return result


def _kernels_with_restarts(args: argparse.Namespace, deadline: float) -> list[dict]:
    """The kernel stage, restarted after the last kernel it reached whenever its process dies or
    quits after a CUDA error (the CUDA context is unusable after an illegal access)."""
    results = args.out / "kernels.jsonl"
    results.unlink(missing_ok=True)
    count = len(json.loads((args.bundle / "kernels" / "index.json").read_text()))
    start = 0
    while start < count and time.monotonic() < deadline:
        outcome = _run_stage("kernels", args, ["--start", str(start)], max(10.0, deadline - time.monotonic()))
        lines = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
        done = {line["id"] for line in lines if "started" not in line}
        for line in lines:
            if "started" in line and line["id"] not in done:
                print(f"  kernel stage died ({outcome['exit']}) in {line['id']}: going on after it", flush=True)
                with open(results, "a") as handle:
                    handle.write(json.dumps({**{k: v for k, v in line.items() if k != "started"},
                                             "error": f"process died ({outcome['exit']})"}) + "\n")
                done.add(line["id"])
        reached = max((int(i[1:]) for i in done if i.startswith("k")), default=start - 1)
        if outcome["exit"] == 0 or reached + 1 <= start:
            break
        start = reached + 1
    lines = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    return [line for line in lines if "started" not in line]


def _summary(results: dict) -> None:
    print("\n==== summary ====")
    env = results.get("env", {})
    print(f"device: {env.get('gpu')} | torch {env.get('torch')} | transformers {env.get('transformers')} | "
          f"tvm {env.get('tvm')} runtime-only={env.get('runtime_only')} "
          f"cuda at import={env.get('cuda_exists_at_import')}")
    for name in ("default", "tuned"):
        model = results.get(f"model_{name}", {})
        shapes = model.get("shapes", {})
        if not shapes:
            print(f"model {name}: no results ({model.get('exit')}, {model.get('error', '')})")
            continue
        worst = max((v.get("max_abs_err", float("inf")) for v in shapes.values()), default=float("nan"))
        print(f"model {name}: worst max abs err {worst:.3g} over {len(shapes)} shapes; "
              f"all <= {TOLERANCE}: {all(v.get('ok') for v in shapes.values())}")
        valid = max((v.get("valid_max_abs_err", float("inf")) for v in shapes.values()), default=float("nan"))
        print(f"   at real (unpadded) positions: worst {valid:.3g}")
        for key, value in shapes.items():
            print(f"   {key:7s} err={value.get('max_abs_err', value.get('error'))} "
                  f"valid={value.get('valid_max_abs_err')} padded={value.get('padded_max_abs_err')} "
                  f"emb={value.get('embedding_max_abs_err')} vs_default={value.get('vs_default_max_abs')} "
                  f"hostref-vs-buildref={value.get('host_ref_vs_build_ref')}")
    for row in results.get("timing", {}).get("rows", []):
        print("   " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    kernels = results.get("kernels", [])
    if kernels:
        checked = [k for k in kernels if "check_ok" in k]
        print(f"kernels: {sum(k['check_ok'] for k in checked)}/{len(checked)} correct; "
              f"{sum(1 for k in kernels if 'error' in k)} errors")
        for k in kernels:
            if "error" in k or not k.get("check_ok", True):
                print(f"   FAIL {k['id']} {k['op']} {k['kernel_name']} lp={k.get('loop_partition')}: "
                      f"{k.get('error') or k.get('check_errors')}")
        timed = [k for k in kernels if k.get("timings") and (k["id"] == "torch" or k.get("check_ok"))]
        torch_row = next((k for k in timed if k["id"] == "torch"), None)
        default = next((k for k in timed if k.get("kernel_name") == "default"), None)
        if torch_row and default:
            print("   dense 384->1536 + bias + GELU, us (torch / ours: above 1, ours is faster):")
            for rows in torch_row["timings"]:
                ours = [k for k in timed if k["id"] != "torch" and rows in k["timings"]]
                best = min(ours, key=lambda k: k["timings"][rows]["us"])
                t, d, b = (x["timings"][rows]["us"] for x in (torch_row, default, best))
                print(f"   T={rows:>5}: torch {t:8.2f}  default rule {d:8.2f} ({t / d:4.2f}x)  best {b:8.2f} "
                      f"({t / b:4.2f}x, {best['kernel_name']}, {best['timings'][rows]['tflops']:.1f} TFLOP/s)")


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    results["env"] = _run_stage("env", args, [], 180)
    print("env: " + json.dumps(results["env"]), flush=True)
    for name in ("default", "tuned"):
        if (args.bundle / "artifacts" / name).is_dir() and time.monotonic() < deadline:
            results[f"model_{name}"] = _run_stage(f"model_{name}", args, [], max(10.0, deadline - time.monotonic()))
    if not args.skip_timing and time.monotonic() < deadline:
        results["timing"] = _run_stage("timing", args, [], max(10.0, deadline - time.monotonic()))
    if (args.bundle / "kernels").is_dir() and time.monotonic() < deadline:
        results["kernels"] = _kernels_with_restarts(args, deadline)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    _summary(results)


def stage(args: argparse.Namespace) -> None:
    work = Path("/tmp/dietserve-remote-check")
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.name == "env":
            result = _stage_env(args.bundle, work)
        elif args.name.startswith("model_"):
            result = _stage_model(args.bundle, work, args.name.removeprefix("model_"))
        elif args.name == "timing":
            result = _stage_timing(args.bundle, work)
        elif args.name == "kernels":
            _stage_kernels(args.bundle, work, args.start, args.out / "kernels.jsonl")
            return
        else:
            raise SystemExit(f"unknown stage {args.name}")
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc()[-3000:]}
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="build the bundle (build machine)")
    p.add_argument("--bundle", type=Path, default=REPO / ".gpu_carry")
    p.add_argument("--quick", action="store_true", help="fewer kernels (no loop partition, 6 sampled)")
    r = commands.add_parser("run", help="check and time on the GPU host")
    r.add_argument("--bundle", type=Path, default=REPO / ".gpu_carry")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/remote-check-out")))
    r.add_argument("--budget-s", type=float, default=480.0, help="stop starting stages after this long")
    r.add_argument("--skip-timing", action="store_true")
    s = commands.add_parser("stage", help=argparse.SUPPRESS)
    s.add_argument("name")
    s.add_argument("--bundle", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--start", type=int, default=0)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.bundle, args.quick)
    elif args.command == "run":
        args.bundle, args.out = args.bundle.resolve(), args.out.resolve()
        _bootstrap(args.bundle)
        args.bundle = Path(os.environ["REMOTE_CHECK_BUNDLE"])  # the expanded copy
        run(args)
    else:
        stage(args)


if __name__ == "__main__":
    main()
