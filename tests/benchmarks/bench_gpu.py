"""The GPU benchmark: bert-base and MiniLM on one GPU, our artifacts beside PyTorch, and each dense
layer's micro-kernels beside cuBLAS in the same precision. Built here, run on a GPU host that has
no TVM compiler, as a stage of the prepared device script:

    .venv/bin/python tests/gpu/remote_check.py prepare       (builds this benchmark's part too)
    python3 tests/gpu/remote_check.py run --out OUT          (on the GPU host; ``--skip-bench``: not it)

What it prints (``report``), each ratio above 1 where ours is faster:

- **End to end**, batch 1 and 8 x seq 1..512, every token real, inputs already on the GPU: our
  fp32 artifact (CUDA-core micro-kernels) against torch eager fp32 (TF32 off), and our fp16
  artifact (tensor-core micro-kernels: fp16 operands, fp32 sums; activations stay fp32) against
  torch sdpa with the model in fp16. Beside them each artifact's worst token cosine and max abs
  error against torch fp32, and its first call at each shape over its median (the artifact is
  compiled ahead; a first call far above the median would be a compile on the request path).
- **Dense layers**, each model's four, at T = 1..4096: the fastest of the kernels carried for it
  (what a plan's decision tree can dispatch to at that T) against torch ``addmm`` with the same
  epilogue in fp32 and in fp16. fp16: any carried kernel, tensor-core or not; fp32: CUDA-core ones.

The plans are hand-made splits (``tests/gpu/carried_artifacts.py``) until a tune has measured on a
GPU: ``remote_check.py prepare --bench-plans DIR`` takes ``DIR/<model>-<precision>/`` instead, the
``--plans`` folders of bundle tunes (``python -m tuner bundle``); the table names which it ran.
bert-base's weights are drawn on the GPU host from the seed the preset uses
(``dietserve/model/seeded_weights.py``), since 440 MB do not fit a visit; MiniLM's are the
checkpoint's, rounded to fp16 and carried by ``remote_check.py``.

    RESULT dense_fp16_vs_cublas=.. dense_fp16_vs_cublas_upto512=.. dense_fp32_vs_cublas=..
           bert_base_fp16_vs_sdpa_b1=.. bert_base_fp16_vs_sdpa_b8x512=.. ...
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

if __name__ == "__main__":  # run as a script: tests.gpu imports from the tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.agreement import token_agreement  # noqa: E402
from tests.benchmarks.timing import geomean  # noqa: E402
from tests.gpu.carried_artifacts import (  # noqa: E402 - after the tree is on the path
    ARCH,
    MAX_BATCH,
    carry_artifact,
    cuda_core_split,
    hand_plans,
    restore_params,
    tensor_core_split,
)
from tests.gpu.kernel_bundle import build_kernels, median_ms, tensor_core_kernels  # noqa: E402

BENCH_FILE = "bench.json"
SPLITS = {"fp32": cuda_core_split, "fp16": tensor_core_split}  # our artifacts' precisions
BATCHES = (1, 8)
SEQS = (1, 16, 64, 128, 256, 512)
DENSE_ROWS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096)
BERT_BASE_SEED = 0  # the bert-base preset's
REPEATS = 30
TORCH_MODELS = {"eager_fp32": ("eager", "float32"), "sdpa_fp32": ("sdpa", "float32"), "sdpa_fp16": ("sdpa", "float16")}
# (ours, theirs) of the end-to-end ratios
PAIRS = {"fp32": "eager_fp32", "fp16": "sdpa_fp16"}


# ----------------------------------------------------------------------------------------------
# prepare (build machine)
# ----------------------------------------------------------------------------------------------

def dense_layers(config: dict) -> list[tuple[str, int, int, str]]:
    """(layer, K, N, epilogue) of each dense layer of a BERT layer, as the model fuses them."""
    hidden, inner = int(config["hidden_size"]), int(config["intermediate_size"])
    return [("qkv", hidden, 3 * hidden, "bias"), ("attention_output", hidden, hidden, "bias_residual"),
            ("ffn_up", hidden, inner, "bias_gelu"), ("ffn_down", inner, hidden, "bias_residual")]


def _dense_cases(model: str, config: dict, quick: bool) -> list[dict]:
    """The kernels carried for each dense layer: the default rule, the hand plans' CUDA-core kernels
    and tensor-core ones, and (not ``quick``) a sample of the H100's space of each kind."""
    import random

    from dietserve.host.hardware import GPU_PRESETS
    from dietserve.kernels.plan.microkernel import MicroKernel
    from dietserve.kernels.space.gpu import gpu_space
    from dietserve.kernels.space.gpu_tensor_core import tensor_core_space
    from tuner.ops import dense

    hand = {name: MicroKernel.from_dict(kernel) for name, kernel in cuda_core_split()[0].items() if kernel}
    fp32 = {"default": None, **hand}
    fp16 = {name: kernel for name, kernel in tensor_core_kernels().items() if name in ("tc_typical", "tc_one_warp")}
    if not quick:
        h100 = GPU_PRESETS["h100"]
        cuda_cores = [k for k in gpu_space(h100) if not k.mma and k.cache_scopes[0] == "shared"]
        fp32.update((f"space_{i}", k) for i, k in enumerate(random.Random(1).sample(cuda_cores, 2)))
        fp16.update((f"tc_space_{i}", k) for i, k in enumerate(random.Random(1).sample(tensor_core_space(h100), 2)))
    cases = []
    for layer, k, n, epilogue in dense_layers(config):
        for precision, kernels in (("fp32", fp32), ("fp16", fp16)):
            for name, kernel in kernels.items():
                cases.append({"op": f"{model} {layer} {k}->{n}", "spec": lambda k=k, n=n, e=epilogue: dense(k, n, e),
                              "kernel_name": name, "kernel": kernel, "loop_partition": False,
                              "precision": precision, "check": (1, 7, 129), "time": DENSE_ROWS})
    return cases


def prepare_bench(bench: Path, work: Path, minilm_checkpoint: Path, cache: Path, quick: bool = False,
                  plans: Path | None = None) -> None:
    """Into ``bench``: each model's artifact in each precision (without weights), the dense layers'
    kernels, and ``bench.json`` (how the GPU host gets each model's weights). ``plans``: a folder
    of ``<model>-<precision>/`` plan folders (a bundle tune's ``--plans``) used where present in
    place of the hand-made ones."""
    from dietserve.compile.artifact import CompileRequest, compile_artifact
    from dietserve.compile.target import TargetSpec
    from dietserve.model.config import BERT_BASE
    from dietserve.model.presets import materialize_random_bert, random_weight_layout

    bert_base = materialize_random_bert(BERT_BASE, work / f"bert-base-random-seed{BERT_BASE_SEED}", BERT_BASE_SEED)
    checkpoints = {"minilm": minilm_checkpoint, "bert-base": bert_base}
    described = {"minilm": {"weights": "carried"},
                 "bert-base": {"weights": {"seed": BERT_BASE_SEED, "layout": random_weight_layout(BERT_BASE)}}}
    shutil.rmtree(bench, ignore_errors=True)
    cases = []
    for model, checkpoint in checkpoints.items():
        config = json.loads((checkpoint / "config.json").read_text())
        (bench / "configs").mkdir(parents=True, exist_ok=True)
        (bench / "configs" / f"{model}.json").write_text(json.dumps(config))
        described[model]["plans"] = {}
        for precision, split in SPLITS.items():
            tuned = plans / f"{model}-{precision}" if plans is not None else None
            if tuned is not None and tuned.is_dir():
                chosen, described[model]["plans"][precision] = tuned, f"tuned: {tuned}"
            else:
                chosen = hand_plans(work / f"bench-plans-{model}-{precision}", checkpoint, cache, split())
                described[model]["plans"][precision] = "hand-made split (tests/gpu/carried_artifacts.py)"
            request = CompileRequest(model=str(checkpoint), target=TargetSpec(kind="cuda", arch=ARCH),
                                     max_batch=MAX_BATCH, plans=(chosen,))
            artifact = compile_artifact(request, cache, work / f"bench-{model}-{precision}", progress=print)
            carry_artifact(artifact, checkpoint, bench / "artifacts" / f"{model}-{precision}")
        cases += _dense_cases(model, config, quick)
    build_kernels(bench / "kernels", cases, ARCH)
    (bench / BENCH_FILE).write_text(json.dumps({"models": described, "batches": BATCHES, "seqs": SEQS}))


# ----------------------------------------------------------------------------------------------
# run (GPU host; the CPU in tests)
# ----------------------------------------------------------------------------------------------

def device_forward(engine, ids: np.ndarray, mask: np.ndarray, types: np.ndarray):
    """A call of the artifact's forward on inputs already on its device (as torch is timed)."""
    import tvm

    from dietserve.runtime.engine import packed_inputs

    positions = np.arange(ids.shape[1], dtype=np.int64)
    arrays = packed_inputs(ids, mask, types, positions) if engine.packed else (ids, mask, types, positions)
    inputs = [tvm.runtime.tensor(np.ascontiguousarray(a), engine.artifact.device) for a in arrays]
    forward, params = engine.artifact.vm["forward"], engine.artifact.params
    return lambda: forward(*inputs, *params)


def measure_shapes(model: str, engines: dict, torch_models: dict, shapes, sync, torch_device: str,
                   repeats: int = REPEATS) -> list[dict]:
    """One row per (batch, seq): each engine's and each torch model's median ms, and each engine's
    agreement with the first torch model (fp32) and first call over its median."""
    import torch

    torch_sync = torch.cuda.synchronize if torch_device == "cuda" else (lambda: None)
    for engine in engines.values():  # the first call of all loads every kernel: not a shape's cost
        engine.run(np.full((1, 3), 1000, np.int64))
    rows = []
    for batch, seq in shapes:
        rng = np.random.default_rng(1000 * batch + seq)
        ids = rng.integers(1000, 30000, (batch, seq)).astype(np.int64)
        mask, types = np.ones_like(ids), np.zeros_like(ids)
        row = {"model": model, "batch": batch, "seq": seq}
        tensors = [torch.from_numpy(a).to(torch_device) for a in (ids, mask, types)]
        reference = None
        for name, torch_model in torch_models.items():
            call = lambda m=torch_model, t=tensors: m(input_ids=t[0], attention_mask=t[1],  # noqa: E731
                                                      token_type_ids=t[2])
            with torch.inference_mode():
                if reference is None:
                    reference = call().last_hidden_state.float().cpu().numpy()
                row[f"torch_{name}_ms"] = median_ms(call, torch_sync, repeats)
        for precision, engine in engines.items():
            call = device_forward(engine, ids, mask, types)
            started = time.perf_counter()
            call()
            sync()
            first = (time.perf_counter() - started) * 1e3
            row[f"ours_{precision}_ms"] = median_ms(call, sync, repeats)
            row[f"ours_{precision}_first_over_median"] = first / row[f"ours_{precision}_ms"]
            cosine, error = token_agreement(engine.run(ids, mask, types).last_hidden_state, reference)
            row[f"ours_{precision}_min_cosine"], row[f"ours_{precision}_max_abs"] = cosine, error
        print("  " + json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        rows.append(row)
    return rows


def _checkpoint(bench: Path, work: Path, model: str, weights) -> Path:
    """The model's checkpoint on the GPU host: MiniLM's carried one (``remote_check.py`` wrote it
    to ``work/checkpoint``), or bert-base's drawn from its seed."""
    if weights == "carried":
        return work / "checkpoint"
    from safetensors.numpy import save_file

    from dietserve.model.seeded_weights import seeded_tensors

    folder = work / f"{model}-seed{weights['seed']}"
    if not (folder / "model.safetensors").exists():
        folder.mkdir(parents=True, exist_ok=True)
        save_file(seeded_tensors(weights["layout"], weights["seed"]), str(folder / "model.safetensors"))
        shutil.copy(bench / "configs" / f"{model}.json", folder / "config.json")
    return folder


def run_models(bench: Path, work: Path) -> dict:
    """The end-to-end rows of every carried model (the GPU host, after ``remote_check``'s env stage)."""
    import torch
    import tvm
    from safetensors.numpy import load_file
    from transformers import BertModel

    from dietserve.runtime.artifact import load_artifact
    from dietserve.runtime.engine import Engine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    described = json.loads((bench / BENCH_FILE).read_text())
    shapes = [(batch, seq) for batch in described["batches"] for seq in described["seqs"]]
    rows, weights_match = [], {}
    for model, about in described["models"].items():
        checkpoint = _checkpoint(bench, work, model, about["weights"])
        tensors = load_file(str(checkpoint / "model.safetensors"))
        engines = {}
        for precision in SPLITS:
            name = f"{model}-{precision}"
            weights_match[name] = restore_params(bench / "artifacts" / name, work / "bench" / name, tensors)
            engines[precision] = Engine(load_artifact(work / "bench" / name, verify_hashes=False))
        theirs = {name: BertModel.from_pretrained(str(checkpoint), attn_implementation=impl,
                                                  dtype=getattr(torch, dtype)).eval().cuda()
                  for name, (impl, dtype) in TORCH_MODELS.items()}
        rows += measure_shapes(model, engines, theirs, shapes, tvm.cuda(0).sync, "cuda")
        del engines, theirs
    return {"rows": rows, "weights_match_manifest": weights_match,
            "plans": {model: about.get("plans") for model, about in described["models"].items()},
            "method": f"wall clock + device sync, median of {REPEATS} after 5 warm-ups; inputs on the GPU; "
                      "torch with TF32 off"}


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------

def dense_ratios(kernels: list[dict]) -> list[dict]:
    """Per dense layer, precision and T: cuBLAS's time over the fastest correct carried kernel's."""
    correct = [k for k in kernels if k.get("check_ok") and k.get("timings")]
    out = []
    for line in (k for k in kernels if k.get("id", "").startswith("torch-") and k.get("timings")):
        precision = line["precision"]
        ours = [k for k in correct if k["op"] == line["op"] and (precision == "fp16" or k.get("precision") == "fp32")]
        for rows, theirs in line["timings"].items():
            timed = [k for k in ours if rows in k["timings"]]
            if timed:
                best = min(timed, key=lambda k: k["timings"][rows]["us"])
                out.append({"op": line["op"], "precision": precision, "rows": int(rows), "torch_us": theirs["us"],
                            "ours_us": best["timings"][rows]["us"], "kernel": best["kernel_name"],
                            "ratio": theirs["us"] / best["timings"][rows]["us"]})
    return out


def summary_metrics(rows: list[dict], dense: list[dict]) -> dict:
    """The RESULT line's numbers."""
    metrics = {}
    for precision in ("fp16", "fp32"):
        chosen = [d["ratio"] for d in dense if d["precision"] == precision]
        metrics[f"dense_{precision}_vs_cublas"] = geomean(chosen)
        metrics[f"dense_{precision}_vs_cublas_upto512"] = geomean(
            d["ratio"] for d in dense if d["precision"] == precision and d["rows"] <= 512)
    for model in dict.fromkeys(row["model"] for row in rows):
        key = model.replace("-", "_")
        for ours, theirs in PAIRS.items():
            def ratio(row, ours=ours, theirs=theirs):
                return row.get(f"torch_{theirs}_ms", math.nan) / row.get(f"ours_{ours}_ms", math.nan)
            mine = [row for row in rows if row["model"] == model]
            metrics[f"{key}_{ours}_vs_{theirs.split('_')[0]}_b1"] = geomean(ratio(r) for r in mine if r["batch"] == 1)
            metrics[f"{key}_{ours}_vs_{theirs.split('_')[0]}_b8"] = geomean(ratio(r) for r in mine if r["batch"] == 8)
            last = max(mine, key=lambda r: (r["batch"], r["seq"]))
            metrics[f"{key}_{ours}_vs_{theirs.split('_')[0]}_b{last['batch']}x{last['seq']}"] = ratio(last)
    for precision in PAIRS:
        metrics[f"min_{precision}_token_cosine"] = min(
            (r[f"ours_{precision}_min_cosine"] for r in rows if f"ours_{precision}_min_cosine" in r), default=math.nan)
        metrics[f"max_{precision}_abs_err"] = max(
            (r[f"ours_{precision}_max_abs"] for r in rows if f"ours_{precision}_max_abs" in r), default=math.nan)
    metrics["max_first_call_over_median"] = max(
        (v for r in rows for k, v in r.items() if k.endswith("_first_over_median")), default=math.nan)
    return metrics


def report(models: dict, kernels: list[dict]) -> dict:
    """Prints the end-to-end and dense tables and the RESULT line; returns the metrics."""
    rows = models.get("rows", [])
    print("\n==== bench_gpu: end to end (ms; ratios: torch over ours, above 1 ours is faster) ====")
    print(f"plans: {models.get('plans')}; weights as the manifests say: {models.get('weights_match_manifest')}")
    print(f"{'model':10s} {'batch':>5s} {'seq':>4s} | {'ours fp32':>9s} {'eager fp32':>10s} {'ratio':>6s} | "
          f"{'ours fp16':>9s} {'sdpa fp16':>9s} {'ratio':>6s} | {'fp16 cos':>9s} {'first/med':>9s}")
    for row in rows:
        cells = [row.get(k, math.nan) for k in ("ours_fp32_ms", "torch_eager_fp32_ms", "ours_fp16_ms",
                                                 "torch_sdpa_fp16_ms", "ours_fp16_min_cosine")]
        first = max((v for k, v in row.items() if k.endswith("_first_over_median")), default=math.nan)
        print(f"{row['model']:10s} {row['batch']:5d} {row['seq']:4d} | {cells[0]:9.3f} {cells[1]:10.3f} "
              f"{cells[1] / cells[0]:6.2f} | {cells[2]:9.3f} {cells[3]:9.3f} {cells[3] / cells[2]:6.2f} | "
              f"{cells[4]:9.6f} {first:9.2f}")
    dense = dense_ratios(kernels)
    if dense:
        print("\n==== bench_gpu: dense layers (us; the fastest carried kernel at each T; cuBLAS over ours) ====")
        for d in dense:
            print(f"{d['op']:32s} {d['precision']} T={d['rows']:>5d}: cuBLAS {d['torch_us']:9.2f}  "
                  f"ours {d['ours_us']:9.2f} ({d['kernel']})  {d['ratio']:5.2f}x")
    metrics = summary_metrics(rows, dense)
    print("RESULT " + " ".join(f"{k}={v:.7f}" if "cosine" in k else f"{k}={v:.3g}" if "abs_err" in k else f"{k}={v:.3f}"
                               for k, v in metrics.items() if math.isfinite(v)), flush=True)
    return metrics


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="?",
                        help="a results.json that remote_check.py run wrote: print its tables again")
    args = parser.parse_args()
    if args.results is None:
        parser.error("the benchmark runs as a stage of tests/gpu/remote_check.py run (see above); "
                     "give a results.json to print its tables")
    results = json.loads(args.results.read_text())
    report(results.get("bench_models", {}), results.get("bench_kernels", []))


if __name__ == "__main__":
    main()
