"""A sparse encoder (SPLADE) of naver/splade-v3's shapes (BERT-base and its masked-language-model
head over a 30,522-entry vocabulary; random weights, seed 0, the default model's tokenizer),
ours from a cold start (plans from the hardware model, packed layout) against the ways users run
it on a CPU: sentence-transformers' SparseEncoder (PyTorch eager), and the model with the same
pooling exported to ONNX, under ONNX Runtime and OpenVINO (fp32). Batch 1 at each length, and
batches of mixed lengths (the peers padded to the longest, as they run them); each round runs
every backend in turn, medians over rounds.

    python tests/benchmarks/bench_sparse.py [--lengths 16 64 128 256 512] [--rounds 3] [--precision bf16]

Prints a table, the largest difference from sentence-transformers, and
``RESULT geomean_vs_best=.. min_vs_best=.. mixed_vs_best=..``. With ``--precision bf16`` ours is
a bf16 build, and OpenVINO runs at its default precision (bf16 where the CPU has AVX512-BF16 or
AMX; the run says which), PyTorch under bf16 autocast; the smallest cosine of ours to the fp32
reference is printed in place of the largest difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bert_baselines  # noqa: E402
from timing import call_seconds, geomean, rotated  # noqa: E402

from dietserve.compile.artifact import CompileRequest, compile_artifact  # noqa: E402
from dietserve.model.presets import default_model_folder  # noqa: E402
from dietserve.model.tokenizer import TOKENIZER_FILES  # noqa: E402
from dietserve.runtime.artifact import load_artifact  # noqa: E402
from dietserve.runtime.engine import Engine  # noqa: E402

FOLDER = Path.home() / ".cache" / "dietserve" / "models" / "splade-bert-base-random-seed0"
MIXED = (8, 32)  # rows of the mixed batches


def sparse_encoder_folder() -> Path:
    """BertForMaskedLM of BERT-base's shapes under SpladePooling, saved by sentence-transformers."""
    if (FOLDER / "modules.json").is_file():
        return FOLDER
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.models import Transformer
    from sentence_transformers.sparse_encoder.models import SpladePooling
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    source = FOLDER.with_name(FOLDER.name + "-mlm")
    BertForMaskedLM(BertConfig()).eval().save_pretrained(str(source))
    for name in TOKENIZER_FILES:
        if (default_model_folder() / name).is_file():
            (source / name).write_bytes((default_model_folder() / name).read_bytes())
    encoder = SparseEncoder(modules=[Transformer(str(source), transformer_task="fill-mask"), SpladePooling("max")])
    encoder.save(str(FOLDER))
    return FOLDER


def onnx_export(folder: Path, path: Path) -> None:
    """The masked-language model and SPLADE's max pooling in one ONNX graph."""
    import torch
    from transformers import BertForMaskedLM

    model = BertForMaskedLM.from_pretrained(str(folder)).eval()

    class Splade(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask, types):
            logits = self.model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
            return torch.log1p(torch.relu(logits * mask[..., None].float())).amax(dim=1)

    example = torch.ones((1, 8), dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    names = list(bert_baselines.INPUTS)
    torch.onnx.export(Splade(), (example, example, torch.zeros_like(example)), str(path), input_names=names,
                      output_names=["sparse"], dynamic_axes=dict.fromkeys(names, axes), dynamo=False)


def backends(folder: Path, threads: int, workdir: Path, precision: str) -> tuple[dict, object]:
    """The runs by name, and sentence-transformers' fp32 run (the reference)."""
    import torch
    from sentence_transformers import SparseEncoder

    torch.set_num_threads(threads)
    request = CompileRequest(model=str(folder), max_batch=max(MIXED), analytic=True, precision=precision)
    ours = Engine(load_artifact(compile_artifact(request, workdir)))
    reference = SparseEncoder(str(folder), device="cpu")

    def pytorch(ids, mask, types, bf16: bool = False):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            feed = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                    "token_type_ids": torch.from_numpy(types)}
            return reference.forward(feed)["sentence_embedding"].float().numpy()

    onnx_path = workdir / "splade.onnx"
    onnx_export(folder, onnx_path)
    runs = {"ours": lambda ids, mask, types: ours.run(ids, mask, types).sentence_embedding}
    if precision == "bf16":
        openvino, chosen = bert_baselines.openvino_default(onnx_path, threads)
        print(f"OpenVINO's default inference precision here: {chosen}")
        runs.update({"pytorch_bf16": lambda *batch: pytorch(*batch, bf16=True), "openvino_default": openvino})
    else:
        runs.update({"pytorch": pytorch, "onnxruntime": bert_baselines.onnx_runtime(onnx_path, threads),
                     "openvino": bert_baselines.openvino(onnx_path, threads)})
    return runs, pytorch


def inputs(rng: np.random.Generator, lengths: list[int]):
    """Random word ids between [CLS] and [SEP], rows padded to the longest."""
    seq = max(lengths)
    ids, mask = np.zeros((len(lengths), seq), np.int64), np.zeros((len(lengths), seq), np.int64)
    for row, length in enumerate(lengths):
        ids[row, :length] = [101, *rng.integers(1000, 30000, length - 2), 102][:length]
        mask[row, :length] = 1
    return ids, mask, np.zeros_like(ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    points = {f"b1 seq {n}": inputs(rng, [n]) for n in args.lengths}
    points.update({f"b{rows} mixed": inputs(rng, list(rng.integers(8, 257, rows))) for rows in MIXED})
    with tempfile.TemporaryDirectory() as workdir:
        runs, reference = backends(sparse_encoder_folder(), args.threads, Path(workdir), args.precision)
        names = list(runs)
        agreement = [(runs["ours"](*batch), reference(*batch)) for batch in points.values()]
        seconds = {point: {name: [] for name in names} for point in points}
        for turn in range(args.rounds):
            for point, batch in points.items():
                for name in rotated(names, turn):
                    runs_each = 1 if batch[0].size >= 2048 else 3
                    seconds[point][name].append(statistics.median(call_seconds(runs[name], batch, runs_each, 1)))
    if args.precision == "bf16":
        cosine = min(float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())
                     for a, b in agreement)
        print(f"smallest cosine of ours to sentence-transformers (fp32) over the points' texts: {cosine:.6f}")
    else:
        worst = max(float(np.abs(a - b).max()) for a, b in agreement)
        print(f"largest |ours - sentence-transformers| over the points: {worst:.2e}")
    print("| point | " + " | ".join(f"{name} (ms)" for name in names) + " | vs best |")
    print("|" + " --- |" * (len(names) + 2))
    ratios = {}
    for point, samples in seconds.items():
        median = {name: statistics.median(values) for name, values in samples.items()}
        ratios[point] = min(median[name] for name in names[1:]) / median["ours"]
        cells = " | ".join(f"{1e3 * median[name]:.2f}" for name in names)
        print(f"| {point} | {cells} | {ratios[point]:.2f}x |")
    single = [ratios[point] for point in ratios if point.startswith("b1 seq")]
    mixed = [ratios[point] for point in ratios if point.endswith("mixed")]
    print(f"RESULT geomean_vs_best={geomean(single):.3f} min_vs_best={min(single):.3f} "
          f"mixed_vs_best={geomean(mixed):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
