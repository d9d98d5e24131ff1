"""A server's start-up for a long-context model: time to ready and memory after warm-up, as the
server warms up now (the largest batch its token budget forms) beside the warm-up it did before
(``--max-batch-size`` rows of the longest sequence), in the same run.

    python tests/benchmarks/bench_startup.py [--positions 8192] [--rounds 2] [--max-batch-size 8]

The model: all-MiniLM-L6-v2's shapes (6 layers of 384) with ``--positions`` positions and random
weights (transformers' initialisation, seed 0), the default model's tokenizer; compiled once
(packed, the CPU default, analytic plans). Each round starts ``python -m dietserve serve`` twice,
alternating: with the default ``--max-batch-tokens`` (2048), and with a budget of
``--max-batch-size`` x positions, at which the warm-up is the old one. For each: seconds from the
process's start to ready, ``dietserve_settled_memory_bytes``, and then the latency of one request
at the longest sequence and of ``--max-batch-size`` rows of it (each answered once, then timed
three times): what a server that warmed up less pays when such a request comes, memory released
after it included.

Last line: ``RESULT ready_s=.. ready_s_before=.. settled_mib=.. settled_mib_before=..
longest_request_ms=.. longest_request_ms_before=..`` (medians over rounds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.model.presets import default_model_folder  # noqa: E402
from tests.integration.scrape import metrics, total  # noqa: E402
from tests.integration.server_process import REPO_ROOT, ServerProcess  # noqa: E402

MODEL = "long"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def long_minilm(folder: Path, positions: int) -> Path:
    """all-MiniLM-L6-v2's shapes with ``positions`` positions, random weights (seed 0)."""
    import torch
    from transformers import BertConfig, BertModel

    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        torch.manual_seed(0)
        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                            max_position_embeddings=positions)
        BertModel(config, add_pooling_layer=False).eval().save_pretrained(str(staging))
        for name in TOKENIZER_FILES:
            shutil.copy(default_model_folder() / name, staging / name)
        os.replace(staging, folder)  # whole or not at all
    return folder


def infer(client, ids: np.ndarray) -> None:
    tensor = triton.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    client.infer(MODEL, [tensor], client_timeout=1200, outputs=[triton.InferRequestedOutput("sentence_embedding")])


def request_ms(url: str, ids: np.ndarray) -> float:
    """Median of three after a first answer."""
    with triton.InferenceServerClient(url) as client:
        infer(client, ids)
        times = []
        for _ in range(3):
            started = time.perf_counter()
            infer(client, ids)
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def start(artifact: Path, budget: int, rows: int, positions: int) -> dict[str, float]:
    started = time.perf_counter()
    server = ServerProcess(artifact, "--max-batch-tokens", str(budget), "--max-batch-size", str(rows),
                           model_name=MODEL, ready_timeout=3600)
    try:
        ready_s = time.perf_counter() - started
        settled = total(metrics(server), "dietserve_settled_memory_bytes") / 2**20
        longest = np.full((1, positions), 2000, np.int64)
        one = request_ms(server.grpc_url, longest)
        full = request_ms(server.grpc_url, np.repeat(longest, rows, axis=0))
        after = total(metrics(server), "dietserve_pool_releases")
    finally:
        server.stop()
    return {"ready_s": ready_s, "settled_mib": settled, "longest_request_ms": one, "rows_request_ms": full,
            "pool_releases": after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dietserve")
    args = parser.parse_args()

    folder = long_minilm(args.cache_dir / "models" / f"minilm-shapes-{args.positions}-seed0", args.positions)
    artifact = args.cache_dir / "artifacts" / f"bench-startup-{args.positions}"
    if not (artifact / "manifest.json").is_file():
        print(f"compiling {folder.name} ...", flush=True)
        subprocess.run([sys.executable, "-m", "dietserve", "compile", "--model", str(folder), "--out", str(artifact),
                        "--max-batch", str(args.max_batch_size), "--cache-dir", str(args.cache_dir)],
                       cwd=REPO_ROOT, check=True)
    budgets = {"now": 2048, "before": args.max_batch_size * args.positions}
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in budgets}
    for round_ in range(args.rounds):
        for kind, budget in budgets.items():
            runs[kind].append(start(artifact, budget, args.max_batch_size, args.positions))
            print(f"round {round_ + 1} {kind:>6} (--max-batch-tokens {budget}): "
                  + ", ".join(f"{key} {value:.1f}" for key, value in runs[kind][-1].items()), flush=True)

    def median(kind: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[kind])

    keys = ("ready_s", "settled_mib", "longest_request_ms", "rows_request_ms")
    print(f"\n{args.positions} positions, {args.max_batch_size} rows, median of {args.rounds} rounds")
    print(f"{'':>22} {'now':>10} {'before':>10} {'now/before':>11}")
    for key in keys:
        now, before = median("now", key), median("before", key)
        print(f"{key:>22} {now:>10.1f} {before:>10.1f} {now / before:>11.3f}")
    print("RESULT " + " ".join(f"{key}={median('now', key):.1f} {key}_before={median('before', key):.1f}"
                               for key in keys[:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
