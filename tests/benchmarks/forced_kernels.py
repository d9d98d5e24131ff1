"""Chosen micro-kernels of one operator, each forced as a plan's only variant, timed side by side
in one process (rounds interleaved, medians): where a kernel-level claim needs no tuning run.

    python tests/benchmarks/forced_kernels.py --op dense_768x3072 --lengths 13,64,512 \
        --kernel 5,48,1,8,384 --kernel 5,48,1,8,384:no-gelu --reference ../shared/reference/dense_gelu_avx2.py
    python tests/benchmarks/forced_kernels.py --op attention_scores --lengths 4,7,13,16 \
        --kernel default --kernel clamped:11,1,1,0 --kernel clamped:4,1,1,1

A kernel is ``mr,panel,panels_per_tile,tiles_per_task,kc`` (packed dense layers),
``clamped:mr,row_tiles,vectors,threads`` (threads: 0 every core, 1 serial),
or ``default`` (the model's default CPU rule). ``:no-gelu`` builds it with the GELU epilogue
replaced by ``v / 2``: the GELU's share of the kernel. ``--reference`` adds the hand-scheduled
dense + GELU kernel (dense_768x3072 only), ``--torch`` PyTorch's (oneDNN's) time in the same
rounds. Prints ms per call. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_baselines as baselines  # noqa: E402
import tvm  # noqa: E402
from bench_kernels import OPERATORS, hand_reference  # noqa: E402
from tvm import tirx  # noqa: E402

import tuner.ops  # noqa: E402
from dietserve.host.cpu import configure_cpu_threads  # noqa: E402
from dietserve.kernels.cpu_clamped.kernel import CLAMPED  # noqa: E402
from dietserve.kernels.decision_tree_func import dispatched_prim_func  # noqa: E402
from dietserve.kernels.plan.kernel_plan import KernelPlan  # noqa: E402
from dietserve.kernels.plan.microkernel import MicroKernel  # noqa: E402
from dietserve.kernels.tir.build import build as build_kernels  # noqa: E402
from tuner.targets import resolve_target  # noqa: E402


def packed_kernel(text: str, lanes: int) -> MicroKernel:
    mr, panel, pk, groups, kc = (int(v) for v in text.split(","))
    return MicroKernel(tile=(("i", (mr,)), ("j", (panel, pk, groups)), ("k", (kc,))), vector=lanes, pack=panel)


def parse_kernel(text: str, lanes: int) -> MicroKernel | None:
    if text == "default":
        return None
    if text.startswith("clamped:"):
        mr, row_tiles, vectors, threads = (int(v) for v in text.split(":", 1)[1].split(","))
        return MicroKernel(tile=(("i", (mr, row_tiles)), ("j", (vectors * lanes,)), ("k", (1,))), vector=lanes,
                           cache_scopes=(CLAMPED,), threads=threads)
    return packed_kernel(text, lanes)


def llvm_target(mcpu: str | None = None):
    """(the target description of this CPU or of ``mcpu``, its tvm Target, fp32 lanes), the
    thread pool sized to this machine."""
    where = resolve_target("llvm", mcpu=mcpu)
    configure_cpu_threads(where.cores)
    return where, tvm.target.Target(where.target), where.hardware.lanes(32)


def build(op: str, kernel: MicroKernel | None, where, target, gelu: bool):
    """The operator with only ``kernel`` (None: the default rule); ``gelu=False``: the GELU
    epilogue replaced by ``v / 2`` while the operator is built."""
    original = tuner.ops.gelu_expr
    if not gelu:
        tuner.ops.gelu_expr = lambda v, *_: v * tirx.const(0.5, "float32")
    try:
        spec = OPERATORS[op]()
    finally:
        tuner.ops.gelu_expr = original
    name = "default" if kernel is None else "v0"
    plan = KernelPlan(workload="forced", operator=spec.name, shape_vars=["T"], axes={}, target=dict(where.target),
                      tvm_version=tvm.__version__, variants={name: None if kernel is None else kernel.to_dict()},
                      tree={"variant": name}, tuned_range={})
    return spec, build_kernels(dispatched_prim_func(spec.func, plan, target), target).jit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", required=True, choices=sorted(OPERATORS))
    parser.add_argument("--lengths", default="7,13,64")
    parser.add_argument("--kernel", action="append", required=True, help="see above (repeatable)")
    parser.add_argument("--reference", type=Path, help="the hand-scheduled dense + GELU kernel")
    parser.add_argument("--torch", action="store_true", help="time PyTorch (oneDNN) in the same rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mcpu", help="build for this CPU (default this one's), e.g. znver3 for AVX2 code here")
    args = parser.parse_args()
    where, target, lanes = llvm_target(args.mcpu)
    timers = {}
    for text in args.kernel:
        kernel_text, _, option = text.partition(":no-") if ":no-" in text else (text, "", "")
        kernel = parse_kernel(kernel_text, lanes)
        spec, lib = build(args.op, kernel, where, target, gelu=option != "gelu")
        pack = 0 if kernel is None else kernel.pack

        def timer(length, spec=spec, lib=lib, pack=pack):
            arguments = baselines.tvm_arguments_packed(spec, {"T": length}, tvm.cpu(0), pack)[0]
            return baselines.time_tvm_module(lib, arguments, tvm.cpu(0), repeat=7)

        timers[text] = timer
    if args.reference:
        timers["reference"] = hand_reference(args.reference)
    if args.torch:
        spec = OPERATORS[args.op]()
        timers["torch"] = lambda length: baselines.time_torch(spec, {"T": length})
    lengths = [int(v) for v in args.lengths.split(",")]
    samples: dict[tuple, list[float]] = {}
    for _round in range(args.rounds):
        for length in lengths:
            for name, timer in timers.items():
                samples.setdefault((length, name), []).append(timer(length))
    print(f"{args.op}, ms per call (median of {args.rounds} interleaved rounds)")
    print(f"{'T':>5} " + " ".join(f"{name:>22}" for name in timers))
    for length in lengths:
        print(f"{length:>5} " + " ".join(f"{statistics.median(samples[(length, name)]) * 1e3:>22.4f}"
                                         for name in timers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
