"""Latency per sequence length (batch 1) of our compiled artifact beside PyTorch eager and
ONNX Runtime on the CPU, same thread count, measured interleaved in one run.

    python tests/benchmarks/bench_bert.py [--model bert-base|default|DIR] [--threads N]

Prints a table and a last line ``RESULT geomean_vs_torch=X geomean_vs_ort=Y`` where a ratio
above 1 means our artifact is faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.compile.artifact import CompileRequest, compile_artifact  # noqa: E402
from dietserve.model.presets import resolve_model  # noqa: E402
from dietserve.runtime.artifact import load_artifact  # noqa: E402
from dietserve.runtime.engine import Engine  # noqa: E402

DEFAULT_LENGTHS = [1, 2, 7, 16, 31, 64, 127, 128, 200, 256, 300, 384, 512]


def timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def export_onnx(model, path: Path) -> None:
    import torch

    class LastHiddenState(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    example = torch.ones((1, 8), dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(
        LastHiddenState(model).eval(), (example, example, torch.zeros_like(example)), str(path),
        input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes}, dynamo=False,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dietserve")
    args = parser.parse_args()

    import onnxruntime as ort
    import torch
    from transformers import BertModel

    torch.set_num_threads(args.threads)

    artifact = compile_artifact(CompileRequest(model=args.model, max_batch=1), args.cache_dir,
                                progress=lambda m: print(f"# {m}", file=sys.stderr))
    engine = Engine(load_artifact(artifact), threads=args.threads)
    folder = resolve_model(args.model, args.cache_dir)
    reference = BertModel.from_pretrained(str(folder)).eval()
    with tempfile.TemporaryDirectory() as scratch:
        onnx_path = Path(scratch) / "bert.onnx"
        export_onnx(reference, onnx_path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])

    print(f"# model={args.model} threads={args.threads} repeats={args.repeats} (median ms, batch 1)")
    print(f"{'seq':>5} {'dietserve':>10} {'torch':>10} {'onnxrt':>10} {'vs_torch':>9} {'vs_ort':>8}")
    vs_torch, vs_ort = [], []
    rng = np.random.default_rng(0)
    for seq in args.lengths:
        ids = rng.integers(1000, engine.vocab_size, (1, seq)).astype(np.int64)
        mask, types = np.ones_like(ids), np.zeros_like(ids)
        tensors = {k: torch.from_numpy(v) for k, v in (("input_ids", ids), ("attention_mask", mask),
                                                       ("token_type_ids", types))}
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}

        def ours(ids=ids, mask=mask, types=types):
            engine.run(ids, mask, types)

        def eager(tensors=tensors):
            with torch.inference_mode():
                reference(**tensors)

        def onnx(feeds=feeds):
            session.run(None, feeds)

        samples = {}
        for name, fn in (("ours", ours), ("torch", eager), ("ort", onnx)):
            # One backend at a time: each runtime's worker threads spin for a while after a
            # call, and interleaving single calls would charge that spinning to the next one.
            time.sleep(0.2)
            fn()  # warm up
            samples[name] = [timed(fn, 1) for _ in range(args.repeats)]
        t_ours, t_torch, t_ort = (statistics.median(samples[k]) for k in ("ours", "torch", "ort"))
        vs_torch.append(t_torch / t_ours)
        vs_ort.append(t_ort / t_ours)
        print(f"{seq:>5} {t_ours * 1e3:>10.2f} {t_torch * 1e3:>10.2f} {t_ort * 1e3:>10.2f} "
              f"{vs_torch[-1]:>9.2f} {vs_ort[-1]:>8.2f}", flush=True)

    def geomean(values: list[float]) -> float:
        return float(np.exp(np.mean(np.log(values))))

    print(f"RESULT geomean_vs_torch={geomean(vs_torch):.3f} geomean_vs_ort={geomean(vs_ort):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
