"""Where a model run's time goes: each PrimFunc call timed through the Relax VM's instrument hook
(the compiled code is untouched). The hook adds a Python call per kernel, and a parallel kernel
of tens of microseconds reads several times its own time (the model's layer_norm, against the
same kernel timed directly after the one that feeds it by kernels_in_isolation.py). Kernels of a
millisecond and more read true. A kernel's gain under the hook need not be the model's: judge
plans with compare_artifacts.py.

    python tests/benchmarks/operator_profile.py ARTIFACT_DIR --lengths 1,64,512 [--batch 1] [--top 12]

prints, per sequence length at the batch given (every sequence that long), the run's median
latency without the hook, then each PrimFunc's median time per run, its calls and its time per
call, slowest first.

    python tests/benchmarks/operator_profile.py ARTIFACT_A ARTIFACT_B --only NAME[,NAME] --rounds 6

with two or more artifacts (builds of one model) compares named PrimFuncs per call, in one
process, the artifacts alternated in every round at every length: each round's median us per
call for each artifact, then the median over rounds. A change of the machine's load falls on
all artifacts alike within a round (on this shared machine a busy spell made attention's
kernels 40% slower for minutes), so a per-call change shows where end-to-end timings cannot
resolve it. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import tvm


def profile_operators(engine, batch: int, seq: int, repeats: int = 3) -> list[tuple[str, float, int]]:
    """(PrimFunc, median seconds per model run, calls per run), slowest first."""
    vm = engine.artifact.vm
    totals: dict[str, list[float]] = defaultdict(list)
    calls: dict[str, int] = defaultdict(int)
    started: dict[str, float] = {}
    current: dict[str, float] = defaultdict(float)

    def instrument(_func, symbol, before_run, _ret, *_args):
        if before_run:
            started[symbol] = time.perf_counter()
        else:
            current[symbol] += time.perf_counter() - started.pop(symbol)
            calls[symbol] += 1
        return 0  # NO_OP: go on as usual

    ids = np.full((batch, seq), 101, np.int64)
    engine.run(ids)  # warm up without the hook
    vm.set_instrument(tvm.runtime.convert(instrument) if hasattr(tvm.runtime, "convert") else instrument)
    try:
        for _ in range(repeats):
            current.clear()
            engine.run(ids)
            for symbol, seconds in current.items():
                totals[symbol].append(seconds)
    finally:
        vm.set_instrument(None)
    rows = [(symbol, float(np.median(values)), calls[symbol] // repeats) for symbol, values in totals.items()]
    return sorted(rows, key=lambda row: -row[1])


def compare_per_call(engines: list, names: list[str], lengths: list[int], rounds: int, repeats: int) -> None:
    """Per-call times of ``names`` in each engine, engines alternated within every round."""
    per_call: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    for round_index in range(rounds):
        print(f"# round {round_index + 1} of {rounds}", file=sys.stderr, flush=True)
        for seq in lengths:
            order = list(enumerate(engines))
            for number, engine in order if round_index % 2 == 0 else reversed(order):
                for symbol, seconds, calls in profile_operators(engine, 1, seq, repeats):
                    if symbol in names:
                        per_call[seq, symbol, number].append(seconds / calls)
    print(f"# us per call: median over {rounds} rounds [each round's median of {repeats} runs]")
    for seq in lengths:
        for symbol in names:
            rounds_of = [per_call.get((seq, symbol, number), []) for number in range(len(engines))]
            medians = [statistics.median(values) if values else float("nan") for values in rounds_of]
            cells = [f"#{number} {median * 1e6:9.1f} [{','.join(f'{v * 1e6:.0f}' for v in values)}]"
                     for number, (median, values) in enumerate(zip(medians, rounds_of, strict=True))]
            ratios = " ".join(f"#{number}/#0 {medians[0] / medians[number]:.2f}" for number in range(1, len(engines)))
            print(f"seq {seq:4d} {symbol[:40]:40s} " + "  ".join(cells) + f"  {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", type=Path, nargs="+", help="compiled artifact directories")
    parser.add_argument("--lengths", default="1,64,512", help="comma-separated sequence lengths")
    parser.add_argument("--repeats", type=int, default=5, help="profiled runs per length")
    parser.add_argument("--batch", type=int, default=1, help="sequences per run, each of the length (default 1)")
    parser.add_argument("--top", type=int, default=12, help="PrimFuncs shown per length")
    parser.add_argument("--only", default="", help="comma-separated PrimFunc names to compare (two or more artifacts)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds alternating the artifacts (two or more)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import call_seconds

    from dietserve.runtime.artifact import load_artifact
    from dietserve.runtime.engine import Engine

    lengths = [int(n) for n in args.lengths.split(",")]
    if len(args.artifacts) > 1:
        if not args.only:
            parser.error("comparing artifacts needs --only NAME[,NAME]: the PrimFuncs to time per call")
        engines = [Engine(load_artifact(path)) for path in args.artifacts]
        for number, path in enumerate(args.artifacts):
            print(f"# #{number}: {path}")
        compare_per_call(engines, args.only.split(","), lengths, args.rounds, args.repeats)
        return
    engine = Engine(load_artifact(args.artifacts[0]))
    for seq in lengths:
        ids = np.full((args.batch, seq), 1000, np.int64)
        latency = statistics.median(call_seconds(engine.run, (ids,), 15))
        rows = profile_operators(engine, args.batch, seq, repeats=args.repeats)
        profiled = sum(r[1] for r in rows)
        print(f"batch {args.batch} x seq {seq}: run {latency * 1e3:.2f} ms, profiled sum {profiled * 1e3:.2f} ms")
        for symbol, seconds, calls in rows[: args.top]:
            print(f"  {symbol[:56]:56s} {seconds * 1e3:9.3f} ms {calls:5d} calls {seconds / calls * 1e6:10.1f} us/call")


if __name__ == "__main__":
    main()
