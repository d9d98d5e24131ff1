"""Where ONNX Runtime's time goes on the same BERT export the end-to-end benchmark runs: ORT's own
profiler (``SessionOptions.enable_profiling``), each node's kernel time summed per operator type
and input shapes, median over the profiled runs, beside the run's own latency. Read it with
``operator_profile.py`` on an artifact (our PrimFuncs per call) to see, operator by operator,
where the two differ: at seq 512 on this host, say, whether a gap is the dense layers' GEMMs or
attention's products and softmax. Not a test.

    python tests/benchmarks/ort_profile.py --model bert-base --lengths 128,512 [--runs 5] [--top 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bert_baselines  # noqa: E402 - a sibling script, not a package

from dietserve.model.presets import resolve_model  # noqa: E402


def profile(onnx_path: Path, threads: int, seq: int, runs: int, warmup: int = 3) -> tuple[list[float], dict]:
    """(each profiled run's ms, {(op type, input shapes): [ms per run]}) at batch 1, length ``seq``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"ort-profile-{os.getpid()}")
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    ids = np.full((1, seq), 101, np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    for _ in range(warmup + runs):
        session.run(None, feed)
    trace = Path(session.end_profiling())
    try:
        events = json.loads(trace.read_text())
    finally:
        trace.unlink(missing_ok=True)
    model_runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-runs:]
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    per_op: dict[tuple, list[float]] = defaultdict(list)
    for run in model_runs:
        start, end = run["ts"], run["ts"] + run["dur"]
        totals: Counter = Counter()
        for node in nodes:
            if start <= node["ts"] <= end:
                shapes = [next(iter(d.values())) for d in node["args"].get("input_type_shape", [])]
                totals[(node["args"]["op_name"], json.dumps(shapes))] += node["dur"] / 1000
        for key, ms in totals.items():
            per_op[key].append(ms)
    return [run["dur"] / 1000 for run in model_runs], per_op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-base", help="a preset name or a checkpoint folder")
    parser.add_argument("--onnx", type=Path, help="an ONNX export to profile (default: export --model's)")
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dietserve")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        onnx_path = args.onnx
        if onnx_path is None:
            from transformers import BertModel

            folder = resolve_model(args.model, args.cache_dir)
            onnx_path = Path(scratch) / "bert.onnx"  # the export bench_bert.py runs ORT on
            reference = BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()
            bert_baselines.export_onnx(reference, onnx_path)
        for seq in (int(t) for t in args.lengths.split(",")):
            latencies, per_op = profile(onnx_path, args.threads, seq, args.runs)
            print(f"seq {seq}: run {statistics.median(latencies):.1f} ms (median of {len(latencies)} profiled runs,"
                  f" {args.threads} threads)")
            ranked = sorted(per_op.items(), key=lambda item: -statistics.median(item[1]))
            for (op, shapes), ms in ranked[:args.top]:
                print(f"  {op:<20} {statistics.median(ms):9.2f} ms   inputs {shapes}")


if __name__ == "__main__":
    main()
