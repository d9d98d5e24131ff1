"""Two or more compiled artifacts of one model side by side, in one process: latency per sequence
length at batch 1 (``--batch``: N sequences of it), rounds interleaved (every artifact at every
length in each round, in turn), so a slow spell of the shared machine falls on all of them alike.
For judging a change of plans (e.g. tuned with the weight cached vs streamed from DRAM) where
separate runs differ by more than the change.

    python tests/benchmarks/compare_artifacts.py BASELINE_DIR CANDIDATE_DIR [...] \
        --lengths 1,7,13,31,64,128 --runs 10 --rounds 5 [--control]

Prints ms per artifact and length (median over rounds of each round's median over ``--runs``),
each artifact's ratio against the first (above 1: faster than the first), and a last line
``RESULT geomean_vs_first=X min_vs_first=Y`` per artifact after the first. ``--control`` loads
the baseline a second time and times it as one more artifact, last: its ratios are what the
machine's noise alone makes of a comparison, the bar a candidate's must clear. Not a test.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import call_seconds  # noqa: E402

from dietserve.runtime.artifact import load_artifact  # noqa: E402
from dietserve.runtime.engine import Engine  # noqa: E402

WARMUP_RUNS = 3


def round_median(engine: Engine, ids: np.ndarray, runs: int) -> float:
    return statistics.median(call_seconds(engine.run, (ids,), runs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", type=Path, nargs="+", help="artifact folders; the first is the baseline")
    parser.add_argument("--lengths", default="1,7,13,31,64,128")
    parser.add_argument("--runs", type=int, default=10, help="model runs per artifact, length and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1, help="sequences a run, each of the length (default 1)")
    parser.add_argument("--control", action="store_true", help="time the baseline twice (the noise floor)")
    parser.add_argument("--tvm-allocated", action="store_true",
                        help="baseline: the first artifact with its weights where TVM allocates them")
    args = parser.parse_args()
    if len(args.artifacts) + args.tvm_allocated + args.control < 2:
        parser.error("give at least two artifacts to compare (or one with --control or --tvm-allocated)")
    lengths = [int(v) for v in args.lengths.split(",")]
    loaded = [load_artifact(path) for path in args.artifacts]
    if args.tvm_allocated:
        loaded.insert(0, load_artifact(args.artifacts[0], huge_pages=False))
        args.artifacts.insert(0, Path(f"{args.artifacts[0]} (weights where TVM allocates them)"))
    control = None
    if args.control:  # the baseline (#0) loaded again, the same way
        baseline = args.artifacts[1] if args.tvm_allocated else args.artifacts[0]  # (#0's folder)
        loaded.append(load_artifact(baseline, huge_pages=not args.tvm_allocated))
        args.artifacts.append(args.artifacts[0])
        control = len(loaded) - 1
    engines = [Engine(artifact, threads=args.threads) for artifact in loaded]
    rng = np.random.default_rng(0)
    inputs = {seq: rng.integers(1000, engines[0].vocab_size, (args.batch, seq)).astype(np.int64) for seq in lengths}
    for engine in engines:
        for ids in inputs.values():
            for _ in range(WARMUP_RUNS):
                engine.run(ids)
    times: dict[tuple[int, int], list[float]] = {}
    for round_index in range(args.rounds):
        print(f"# round {round_index + 1} of {args.rounds}", file=sys.stderr, flush=True)
        for seq in lengths:
            for index, engine in enumerate(engines):
                times.setdefault((index, seq), []).append(round_median(engine, inputs[seq], args.runs))
    labels = [f"#{index}" for index in range(len(engines))]
    for index, path in enumerate(args.artifacts):
        print(f"# {labels[index]}: {path}{' (control: the baseline again)' if index == control else ''}")
    print(f"# batch {args.batch}")
    print(f"{'seq':>5} " + " ".join(f"{label + ' ms':>10}" for label in labels)
          + " " + " ".join(f"{label + '/#0':>8}" for label in labels[1:]))
    ratios: dict[int, list[float]] = {index: [] for index in range(1, len(engines))}
    for seq in lengths:
        medians = [statistics.median(times[(index, seq)]) for index in range(len(engines))]
        for index in ratios:
            ratios[index].append(medians[0] / medians[index])
        print(f"{seq:>5} " + " ".join(f"{m * 1e3:>10.2f}" for m in medians)
              + " " + " ".join(f"{ratios[index][-1]:>8.3f}" for index in ratios))
    for index, values in ratios.items():
        geomean = math.exp(sum(math.log(v) for v in values) / len(values))
        name = f"{labels[index]} control" if index == control else labels[index]
        print(f"RESULT {name} geomean_vs_first={geomean:.3f} min_vs_first={min(values):.3f}"
              f" max_vs_first={max(values):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
