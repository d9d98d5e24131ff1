"""The attention tune's tile choice when its tiles are timed in the plain kernel (what every model's
tune did before the task named its kernels) against timed in the kernels the model serves
(masks, shared heads, each kernel weighted by its layers), both priced in the served kernels.

    python tests/benchmarks/attention_timed_as_served.py MODEL_FOLDER --max-len 2048 --rounds 2

Each round times every tile both ways (``tuner.measure.attention``, in its own process); each
round's two choices are priced on the other round's served timings, so a choice is not priced
by the noise it was made on. Prints the tiles each way chose per length group and their cost
(ms per sequence and layer, weighted over the lengths), the best the other round allows, and
``RESULT served_vs_plain=X`` per round (above 1: the choice timed as served costs less). Not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.compile.packed_attention import attention_task  # noqa: E402
from dietserve.host.cpu import available_cpus, cpu_flags, host_cpu  # noqa: E402
from dietserve.host.hardware import detect_cpu  # noqa: E402
from dietserve.kernels.cpu_varlen.tile import attention_tiles  # noqa: E402
from dietserve.kernels.plan.decision_tree import segment  # noqa: E402
from dietserve.kernels.plan.task_file import AttentionTask  # noqa: E402
from dietserve.model.config import BertConfig  # noqa: E402
from tuner.attention import MAX_TILES, length_groups, measure_tiles, tiles_job  # noqa: E402
from tuner.measure.timing import TimingPolicy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a checkpoint folder (its config.json is read)")
    parser.add_argument("--max-len", type=int, default=512, help="the longest sequence the lengths span")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = BertConfig.from_dict(json.loads((args.model / "config.json").read_text()))
    cores = len(available_cpus())
    hardware = detect_cpu(cpu_flags() or set()).with_overrides(cores=cores)
    served = attention_task(config, args.max_len, [])
    plain = AttentionTask(served.heads, served.head_dim, args.max_len)
    tiles, groups = attention_tiles(hardware, served.head_dim), length_groups(served)
    shares = np.array([share for _, _, share in groups])
    print(f"kernels {[dataclasses.asdict(k) for k in served.kernels]}, kv_heads {served.kv_heads}, "
          f"{len(tiles)} tiles, timed at lengths {[timed for _, timed, _ in groups]}", flush=True)

    target = {"kind": "llvm", "mcpu": host_cpu(), "num-cores": cores}

    def timed(task: AttentionTask) -> np.ndarray:
        job = tiles_job(task, target, cores, tiles, [length for _, length, _ in groups], TimingPolicy())
        return np.array([result["latencies"] for result in measure_tiles(job, 3600)])

    rounds = [{"plain": timed(plain), "served": timed(served)} for _ in range(max(2, args.rounds))]
    for index, this in enumerate(rounds):
        other = rounds[(index + 1) % len(rounds)]["served"]
        costs = {}
        for way in ("plain", "served"):
            labels = segment(this[way] * shares, MAX_TILES)
            costs[way] = sum(other[label, group] * shares[group] for group, label in enumerate(labels))
            print(f"round {index + 1}, timed {way:6s}: {costs[way] * 1e3:8.3f} ms  "
                  f"{[tiles[label].describe() for label in labels]}")
        print(f"round {index + 1}, the best per group: {float(other.min(axis=0) @ shares) * 1e3:8.3f} ms")
        print(f"RESULT round={index + 1} served_vs_plain={costs['plain'] / costs['served']:.4f}", flush=True)


if __name__ == "__main__":
    main()
