"""Where a model run's time goes: each PrimFunc call timed through the Relax VM's instrument hook
(the compiled code is untouched; the hook adds a Python call per kernel, so totals read a little
high for tiny shapes)."""

from __future__ import annotations

import time
from collections import defaultdict

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
