"""Latency of one compiled artifact in this process, per sequence length: p50 / p90 / p99 / max
over repeated runs of ``Engine.run`` (batch 1). For checking a point another benchmark read as an
outlier, in a fresh process, without other libraries' threads around.

    python tests/benchmarks/engine_latency.py ARTIFACT_DIR --lengths 7,64,191 --runs 30
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import call_seconds  # noqa: E402

from dietserve.runtime.artifact import load_artifact  # noqa: E402
from dietserve.runtime.engine import Engine  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--lengths", default="7,64,191")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    engine = Engine(load_artifact(args.artifact), threads=args.threads)
    for seq in (int(v) for v in args.lengths.split(",")):
        ids = np.full((1, seq), 1000, np.int64)
        ms = np.asarray(call_seconds(engine.run, (ids,), args.runs, warmup=3)) * 1e3
        print(f"seq={seq} p50={np.median(ms):.2f} p90={np.percentile(ms, 90):.2f} p99={np.percentile(ms, 99):.2f} "
              f"max={ms.max():.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
