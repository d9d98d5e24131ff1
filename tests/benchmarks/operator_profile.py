"""Where a model run's time goes: each PrimFunc call timed through the Relax VM's instrument hook
(the compiled code is untouched; the hook adds a Python call per kernel, so totals read a little
high for tiny shapes).

    python tests/benchmarks/operator_profile.py ARTIFACT_DIR --lengths 1,64,512 [--top 12]

prints, per sequence length at batch 1, the run's median latency without the hook, then each
PrimFunc's median time per run, its calls and its time per call, slowest first. Not a test.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="a compiled artifact directory")
    parser.add_argument("--lengths", default="1,64,512", help="comma-separated sequence lengths")
    parser.add_argument("--repeats", type=int, default=5, help="profiled runs per length")
    parser.add_argument("--top", type=int, default=12, help="PrimFuncs shown per length")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import call_seconds

    from dietserve.runtime.artifact import load_artifact
    from dietserve.runtime.engine import Engine

    engine = Engine(load_artifact(args.artifact))
    for seq in (int(n) for n in args.lengths.split(",")):
        ids = np.full((1, seq), 1000, np.int64)
        latency = statistics.median(call_seconds(engine.run, (ids,), 15))
        rows = profile_operators(engine, 1, seq, repeats=args.repeats)
        print(f"seq {seq}: run {latency * 1e3:.2f} ms, profiled sum {sum(r[1] for r in rows) * 1e3:.2f} ms")
        for symbol, seconds, calls in rows[: args.top]:
            print(f"  {symbol[:56]:56s} {seconds * 1e3:9.3f} ms {calls:5d} calls {seconds / calls * 1e6:10.1f} us/call")


if __name__ == "__main__":
    main()
