"""Run the CUDA paths on a GPU host that has no TVM compiler and no TVM at all.

Two entry points:

    prepare  (here, the build machine: .venv, nvcc)
        .venv/bin/python tests/gpu/remote_check.py prepare [--bundle .gpu_carry] [--quick] [--skip-bench]
    run      (the GPU host: python3 with torch + transformers, TVM neither installed nor needed)
        python3 tests/gpu/remote_check.py run [--bundle .gpu_carry] [--out DIR]

``prepare`` (``prepare_bundle.py``) writes a bundle (< 64 MiB; keep its folder ignored by git,
e.g. ``/.gpu_carry/`` in ``.git/info/exclude``):

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
  (Both carried without weights: ``carried_artifacts.py``.)
* ``kernels/``: CUDA micro-kernels applied with local padding (``dietserve.kernels.cuda.kernel``,
  tensor-core ones ``cuda.tensor_core``), each exported with its fatbin (``kernel_bundle.py``):
  the cases of ``test_tuner_cuda_gpu.py`` (checked at ragged lengths) and a sample of the H100's
  space for MiniLM's 384->1536 dense+GELU, timed against the default rule and torch.
* ``bench/``: the GPU benchmark's artifacts (MiniLM and bert-base, fp32 and fp16) and each dense
  layer's kernels (``tests/benchmarks/bench_gpu.py``).
* ``local_reference.npz``: transformers on this machine for a few shapes, to check the GPU
  host's own reference (transformers on its CPU) against.

``run`` installs the wheel and the runtime package under /tmp, re-executes itself with
``TVM_USE_RUNTIME_LIB=1``, then, each stage in a child process (a crashing kernel costs only its
stage), checks both artifacts against transformers (max abs error, bar 1e-4) for batch 1/3/8 x
seq 1..512, runs the benchmark (its end-to-end and dense tables and RESULT line), and checks and
times the kernels, within ``--budget-s`` (480 s). Results: ``OUT/results.json`` and a summary on
stdout; ``python tests/benchmarks/bench_gpu.py OUT/results.json`` prints the benchmark's tables
again. Errors are given over all positions (as tests/gpu/test_cuda_numerics.py compares them)
and over real, unpadded ones: the outputs at padded positions (never used) deviate more, on CPU
artifacts too (H100, 2026-11: real <= 6e-6, padded up to 2.6e-4 at batch 8 x seq 512; the CPU
artifact: 8.7e-6 and 1.2e-4 on the same inputs).

With the device tool: ``run(command="set -o pipefail; python3 tests/gpu/remote_check.py run
--out $OUT 2>&1 | tee $OUT/log.txt", carry=[".gpu_carry"])``.
"""

from __future__ import annotations

import argparse
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
if str(REPO) not in sys.path:  # run as a script: tests.gpu and tests.benchmarks import from the tree
    sys.path.insert(0, str(REPO))

from tests.gpu.carried_artifacts import PARAMS_FILE, restore_params, sha256_file  # noqa: E402 - after the path
from tests.gpu.kernel_bundle import INDEX_FILE, check_and_time  # noqa: E402
from tests.gpu.prepare_bundle import BATCHES, SEQS, prepare  # noqa: E402

TOLERANCE = 1e-4

def _bootstrap(bundle: Path) -> None:
    """Install the runtime under /tmp/dietserve-rt and re-execute with it (once)."""
    if os.environ.get("REMOTE_CHECK_READY") == "1":
        return
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

    checkpoint = work / "checkpoint"
    if not (checkpoint / "model.safetensors").exists():
        checkpoint.mkdir(parents=True, exist_ok=True)
        half = load_file(str(bundle / "model" / "model.f16.safetensors"))
        full = {n: t.astype(np.float32) if t.dtype == np.float16 else t for n, t in half.items()}
        save_file(full, str(checkpoint / "model.safetensors"))
        shutil.copy(bundle / "model" / "config.json", checkpoint / "config.json")
    full = load_file(str(checkpoint / "model.safetensors"))
    report = {source.name: {"params_sha256_matches_manifest": restore_params(source, work / "artifacts" / source.name,
                                                                             full)}
              for source in sorted((bundle / "artifacts").iterdir())}
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


def _kernels_with_restarts(args: argparse.Namespace, folder: Path, deadline: float) -> list[dict]:
    """The kernel stage over ``folder`` (``kernel_bundle.py``), restarted after the last kernel it
    reached whenever its process dies or quits after a CUDA error (the CUDA context is unusable
    after an illegal access)."""
    results = args.out / f"{folder.relative_to(args.bundle).as_posix().replace('/', '_')}.jsonl"
    results.unlink(missing_ok=True)
    count = len(json.loads((folder / INDEX_FILE).read_text()))
    start = 0
    while start < count and time.monotonic() < deadline:
        outcome = _run_stage("kernels", args, ["--start", str(start), "--kernels", str(folder), "--results",
                                               str(results)], max(10.0, deadline - time.monotonic()))
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
    kernels = results.get("kernels", [])
    if kernels:
        checked = [k for k in kernels if "check_ok" in k]
        print(f"kernels: {sum(k['check_ok'] for k in checked)}/{len(checked)} correct; "
              f"{sum(1 for k in kernels if 'error' in k)} errors")
        for k in kernels:
            if "error" in k or not k.get("check_ok", True):
                print(f"   FAIL {k['id']} {k['op']} {k['kernel_name']} lp={k.get('loop_partition')}: "
                      f"{k.get('error') or k.get('check_errors')}")
        from tests.benchmarks.bench_gpu import dense_ratios

        default = next((k for k in kernels if k.get("kernel_name") == "default" and k.get("check_ok")), None)
        if default is not None:
            print("   dense 384->1536 + bias + GELU, us (torch fp32 / ours: above 1, ours is faster):")
            for best in dense_ratios(kernels):
                t, d = best["torch_us"], default["timings"][str(best["rows"])]["us"]
                print(f"   T={best['rows']:>5}: torch {t:8.2f}  default rule {d:8.2f} ({t / d:4.2f}x)  best "
                      f"{best['ours_us']:8.2f} ({best['ratio']:4.2f}x, {best['kernel']})")


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    results["env"] = _run_stage("env", args, [], 180)
    print("env: " + json.dumps(results["env"]), flush=True)
    for name in ("default", "tuned"):
        if (args.bundle / "artifacts" / name).is_dir() and time.monotonic() < deadline:
            results[f"model_{name}"] = _run_stage(f"model_{name}", args, [], max(10.0, deadline - time.monotonic()))
    bench = args.bundle / "bench"
    if bench.is_dir() and not args.skip_bench and time.monotonic() < deadline:
        results["bench_models"] = _run_stage("bench", args, [], max(10.0, deadline - time.monotonic()))
        if time.monotonic() < deadline:
            results["bench_kernels"] = _kernels_with_restarts(args, bench / "kernels", deadline)
    if (args.bundle / "kernels").is_dir() and time.monotonic() < deadline:
        results["kernels"] = _kernels_with_restarts(args, args.bundle / "kernels", deadline)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    _summary(results)
    if "bench_models" in results:
        from tests.benchmarks.bench_gpu import report

        report(results["bench_models"], results.get("bench_kernels", []))


def stage(args: argparse.Namespace) -> None:
    work = Path("/tmp/dietserve-remote-check")
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.name == "env":
            result = _stage_env(args.bundle, work)
        elif args.name.startswith("model_"):
            result = _stage_model(args.bundle, work, args.name.removeprefix("model_"))
        elif args.name == "bench":
            from tests.benchmarks.bench_gpu import run_models

            _cuda_runtime()
            result = run_models(args.bundle / "bench", work)
        elif args.name == "kernels":
            _cuda_runtime()
            check_and_time(args.kernels, args.start, args.results)
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
    p.add_argument("--quick", action="store_true",
                   help="fewer kernels (no loop partition; the benchmark: fewer candidates a dense layer)")
    p.add_argument("--skip-bench", action="store_true", help="leave bench_gpu.py's artifacts and kernels out")
    p.add_argument("--bench-plans", type=Path,
                   help="bench_gpu.py: DIR/<model>-<precision>/ plan folders to use in place of hand-made ones")
    r = commands.add_parser("run", help="check and time on the GPU host")
    r.add_argument("--bundle", type=Path, default=REPO / ".gpu_carry")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/remote-check-out")))
    r.add_argument("--budget-s", type=float, default=480.0, help="stop starting stages after this long")
    r.add_argument("--skip-bench", action="store_true", help="leave bench_gpu.py's tables out")
    s = commands.add_parser("stage", help=argparse.SUPPRESS)
    s.add_argument("name")
    s.add_argument("--bundle", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--start", type=int, default=0)
    s.add_argument("--kernels", type=Path, help="kernels: the folder of the kernels to check and time")
    s.add_argument("--results", type=Path, help="kernels: the JSON lines file to append to")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.bundle, args.quick, args.skip_bench, args.bench_plans)
    elif args.command == "run":
        args.bundle, args.out = args.bundle.resolve(), args.out.resolve()
        _bootstrap(args.bundle)
        args.bundle = Path(os.environ["REMOTE_CHECK_BUNDLE"])  # the expanded copy
        run(args)
    else:
        stage(args)


if __name__ == "__main__":
    main()
