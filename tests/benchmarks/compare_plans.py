"""Plans of one operator timed side by side: the tuner's choices compared, not the host's spells.

    python tests/benchmarks/compare_plans.py dense_3072x768 A.plan.json B.plan.json ... \
        [--lengths 1,7,31,64,128,257,512] [--rounds 7] [--labels a,b,...]

Each plan (``bench_kernels.py --save-plans``, or ``python -m tuner tune --out``) is built once;
then, length by length, the plans are timed in turn, round after round, the order reversed every
other round (``interleaved_medians``), each turn as many calls as fill ``MIN_TURN_S``, so a slow
spell of a shared host falls on each plan alike. Prints each plan's median ms
per length, its time over the first plan's (per length and geomean), and how far apart the plans
are at each length (slowest over fastest). The last line is ``RESULT geomean_vs_first=...`` (one
per plan after the first, >1: slower than the first) ``spread_geomean=...``. Not a test: run it
on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels  # noqa: E402
import kernel_baselines as baselines  # noqa: E402
import tvm  # noqa: E402

from dietserve.host.cpu import configure_cpu_threads  # noqa: E402
from dietserve.kernels.plan.kernel_plan import KernelPlan  # noqa: E402
from tuner.targets import resolve_target  # noqa: E402

MIN_TURN_S = 0.01


def turn(function, arguments) -> float:
    """Seconds per call over as many calls as fill ``MIN_TURN_S``."""
    calls, start = 0, time.perf_counter()
    while True:
        function(*arguments)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= MIN_TURN_S:
            return elapsed / calls


def interleaved_medians(timers: list, rounds: int) -> list[float]:
    """Each of ``timers`` (a turn's seconds per call) called in turn, ``rounds`` rounds, the order
    reversed every other round; the median of each one's turns."""
    samples: list[list[float]] = [[] for _ in timers]
    for round_ in range(rounds):
        order = range(len(timers)) if round_ % 2 == 0 else reversed(range(len(timers)))
        for index in order:
            samples[index].append(timers[index]())
    return [statistics.median(own) for own in samples]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=sorted(bench_kernels.OPERATORS))
    parser.add_argument("plans", type=Path, nargs="+")
    parser.add_argument("--lengths", default="1,7,13,31,64,97,128,200,257,384,512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--labels", help="comma-separated names of the plans (default: their files)")
    args = parser.parse_args(argv)
    if len(args.plans) < 2:
        parser.error("give at least two plans")
    labels = args.labels.split(",") if args.labels else [str(path) for path in args.plans]
    if len(labels) != len(args.plans):
        parser.error(f"{len(labels)} labels for {len(args.plans)} plans")
    lengths = [int(t) for t in args.lengths.split(",")]

    where = resolve_target("llvm")
    configure_cpu_threads(where.cores)
    spec = bench_kernels.OPERATORS[args.op]()
    device = tvm.cpu(0)
    plans = [KernelPlan.read(path) for path in args.plans]
    libraries = [bench_kernels.compile_ours(spec, plan, where.target) for plan in plans]
    turns = {}  # (plan index, length) -> a turn's seconds per call
    for index, (plan, library) in enumerate(zip(plans, libraries, strict=True)):
        for length in lengths:
            arguments, inputs = baselines.tvm_arguments_packed(spec, {"T": length}, device, plan.pack)
            library["main"](*arguments)
            baselines.check_against_reference(spec, arguments[-1].numpy(), inputs)
            turns[index, length] = lambda f=library["main"], a=arguments: turn(f, a)
    order = list(range(len(plans)))
    medians = {}
    for length in lengths:
        latencies = interleaved_medians([turns[index, length] for index in order], args.rounds)
        medians.update({(index, length): latency for index, latency in zip(order, latencies, strict=True)})
        print(f"[compare] T = {length}: {args.rounds} rounds", file=sys.stderr, flush=True)

    print("    T  " + "  ".join(f"{label[-14:]:>14}" for label in labels) + "  spread")
    spreads = []
    for length in lengths:
        row = [medians[index, length] for index in order]
        spreads.append(max(row) / min(row))
        cells = [f"{row[0] * 1e3:>11.3f} ms"] + [f"{t * 1e3:>7.3f} {t / row[0]:>5.2f}x" for t in row[1:]]
        print(f"{length:>5}  " + "  ".join(f"{cell:>14}" for cell in cells) + f"  {spreads[-1]:.3f}")
    ratios = [bench_kernels.geomean([medians[index, t] / medians[0, t] for t in lengths]) for index in order[1:]]
    for label, ratio in zip(labels[1:], ratios, strict=True):
        print(f"{label}: {ratio:.3f}x the time of {labels[0]} (geomean over T)")
    ratio_text = ",".join(f"{r:.3f}" for r in ratios)
    print(f"RESULT geomean_vs_first={ratio_text} spread_geomean={bench_kernels.geomean(spreads):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
