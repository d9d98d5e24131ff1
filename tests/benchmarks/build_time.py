"""How long one packed micro-kernel takes to build (what each tuning trial pays before it is
timed), and where that time goes: applying the kernel (our IR builder), TVM's passes, and LLVM.

    python tests/benchmarks/build_time.py --op dense_768x3072 --kernel 8,48,1,4,1 --kernel 6,48,1,1,384 \
        [--without epilogue-loop] [--repeats 3] [--passes 8]

Each ``--kernel mr,panel,panels_per_tile,tiles_per_task,kc`` is built ``--repeats`` times for
this CPU (the median printed); ``--without FEATURE`` builds it also without one of the packed
kernel's features (``cold_weights.FEATURES``), side by side. ``--passes N`` prints the N
slowest TVM passes of one build (``PassTimingInstrument``); the rest of the compile time is
LLVM's code generation. The kernels are applied for this machine's target as the tuner applies
them (its cores take the tasks at run time, its CPU picks the prefetches) and lowered with our
TIR pipeline (``dietserve/kernels/tir/build.py``; TVM's default one cannot bound their vector
indices). Not a test: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tvm  # noqa: E402
from bench_kernels import OPERATORS  # noqa: E402
from cold_weights import FEATURES, settings_without  # noqa: E402
from forced_kernels import llvm_target, packed_kernel  # noqa: E402
from tvm.ir.instrument import PassTimingInstrument  # noqa: E402

from dietserve.kernels.apply import apply_kernel  # noqa: E402
from dietserve.kernels.tir.build import build  # noqa: E402


def build_once(op: str, kernel, target, settings, profile: bool = False) -> tuple[float, float, str]:
    """(seconds applying the kernel with ``settings``, seconds compiling it, the TVM passes'
    timing report if ``profile``) of one build."""
    spec = OPERATORS[op]()
    start = time.perf_counter()
    func = apply_kernel(spec.func, kernel, target, settings=settings)
    applied = time.perf_counter()
    timing = PassTimingInstrument()
    with tvm.transform.PassContext(instruments=[timing] if profile else []):
        build(func, target)
        report = timing.render() if profile else ""  # (inside: leaving the context clears it)
    return applied - start, time.perf_counter() - applied, report


def pass_times(rendered: str) -> list[tuple[float, str]]:
    """(seconds of its own, name) of every pass in a ``PassTimingInstrument.render()`` report
    (the bracketed figure), the slowest first."""
    own = []
    for line in rendered.splitlines():
        match = re.match(r"\s*([\w.]+): \d+us \[(\d+)us\]", line)
        if match:
            own.append((int(match.group(2)) / 1e6, match.group(1)))
    return sorted(own, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="dense_768x3072", choices=[op for op in OPERATORS if op.startswith("dense")])
    parser.add_argument("--kernel", action="append", required=True,
                        help="mr,panel,panels_per_tile,tiles_per_task,kc (repeatable)")
    parser.add_argument("--without", action="append", default=[], choices=list(FEATURES),
                        help="also build each kernel without this feature (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passes", type=int, default=0, help="print this many of the slowest TVM passes")
    args = parser.parse_args()
    _where, target, lanes = llvm_target()
    print(f"{args.op}, seconds per build (median of {args.repeats})")
    print(f"{'kernel':>16} {'without':>14} {'apply':>7} {'compile':>8} {'total':>7} {'x full':>8}")
    for text in args.kernel:
        kernel = packed_kernel(text, lanes)
        full = None
        for without in [None, *args.without]:
            settings = settings_without(target, without)
            builds = [build_once(args.op, kernel, target, settings) for _ in range(args.repeats)]
            rendered = build_once(args.op, kernel, target, settings, True)[2] if args.passes else ""
            apply_s = statistics.median(b[0] for b in builds)
            compile_s = statistics.median(b[1] for b in builds)
            total = apply_s + compile_s
            ratio = f"{total / full:>7.2f}x" if full else f"{'-':>8}"
            full = full or total
            print(f"{text:>16} {without or '-':>14} {apply_s:>7.2f} {compile_s:>8.2f} {total:>7.2f} {ratio}",
                  flush=True)
            if args.passes:
                passes = pass_times(rendered)
                in_passes = sum(seconds for seconds, _ in passes)
                print(f"{'':>16}   TVM passes {in_passes:.2f} s in all, LLVM and the rest "
                      f"{compile_s - in_passes:.2f} s; slowest: "
                      + ", ".join(f"{name} {seconds:.2f}" for seconds, name in passes[:args.passes]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
