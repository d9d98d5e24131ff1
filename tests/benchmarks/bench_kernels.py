"""BERT-base's dynamic operators across sequence lengths: our DietCode-tuned kernels (one tuning
run per operator covering every T in 1..512) beside PyTorch, numpy, TVM's untuned default and
MetaSchedule tuned per static shape on 8 sampled T with the same total trial budget.

    python tests/benchmarks/bench_kernels.py [--trials 64] [--ops dense_768x3072,attention_scores]
                                             [--target llvm|cuda] [--skip-metaschedule]

Per operator it prints a table of latency per T and ratios (>1: ours faster); the last line is
``RESULT geomean_vs_torch=X min_vs_torch=Y geomean_vs_metaschedule=Z tuning_time_ratio=W``:
torch and MetaSchedule latency over ours (geomean over every operator and T, min over them),
and MetaSchedule's tuning wall time over ours. Not a test: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_baselines as baselines  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402

from dietserve.kernels.dispatch import dispatched_prim_func  # noqa: E402
from tuner.database.records import RecordDatabase  # noqa: E402
from tuner.measure.runner import LocalRunner, MeasureOptions  # noqa: E402
from tuner.ops import attention_context, attention_scores, dense  # noqa: E402
from tuner.targets import resolve_target  # noqa: E402
from tuner.task import ShapeVar, TuningTask  # noqa: E402
from tuner.tune import TuneOptions, Tuner  # noqa: E402

LENGTHS = [1, 2, 7, 13, 31, 64, 97, 127, 128, 129, 200, 257, 300, 384, 449, 512]  # 16, with primes
METASCHEDULE_LENGTHS = [1, 13, 64, 128, 200, 300, 449, 512]
OPERATORS = {
    "dense_768x768": lambda: dense(768, 768, "bias"),
    "dense_768x3072": lambda: dense(768, 3072, "bias_gelu"),
    "dense_3072x768": lambda: dense(3072, 768, "bias"),
    "attention_scores": lambda: attention_scores(12, 64),
    "attention_context": lambda: attention_context(12, 64),
}


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def tune_ours(spec, target: dict, space: list, cores: int, trials: int, folder: Path):
    task = TuningTask.create(spec, target, ShapeVar("T", range(1, 513)))
    database = RecordDatabase(folder / f"{spec.name}.jsonl")
    with LocalRunner(MeasureOptions(number=2, repeat=3, timeout_s=60)) as runner:
        result = Tuner(task, space, cores, runner, database, TuneOptions(trials=trials)).run()
    return result


def time_ours(spec, plan, target: dict, length: int) -> float:
    host = target.get("host")
    device_target = {k: v for k, v in target.items() if k != "host"}
    tvm_target = tvm.target.Target(device_target, host=host) if host else tvm.target.Target(device_target)
    lib = tvm.compile(dispatched_prim_func(spec.func, plan, tvm_target), tvm_target).jit()
    device = tvm.cuda(0) if target["kind"] == "cuda" else tvm.cpu(0)
    args, inputs = baselines.tvm_arguments(spec, {"T": length}, device)
    lib["main"](*args)
    baselines.check_against_reference(spec, args[-1].numpy(), inputs)
    return baselines.time_tvm_module(lib, args, device, repeat=15, time_cap_s=10)


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=64, help="trials per operator, ours and MetaSchedule's")
    parser.add_argument("--ops", default=",".join(OPERATORS), help=f"comma-separated subset of {list(OPERATORS)}")
    parser.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--skip-metaschedule", action="store_true")
    parser.add_argument("--skip-default", action="store_true", help="skip TVM's untuned default (slow on llvm)")
    args = parser.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    where = resolve_target(args.target)
    target, space, cores = where.target, where.space, where.cores
    if args.target == "llvm":
        # TVM kernels timed here get every core, as the served model's do (TVM's default pool has
        # half the cores on x86: earlier runs timed every TVM kernel on one core of two).
        from dietserve.kernels.host import configure_cpu_threads

        configure_cpu_threads(cores)
    device = "cuda" if args.target == "cuda" else "cpu"
    vs_torch, vs_ms, ours_tuning, ms_tuning = [], [], 0.0, 0.0
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as scratch:
        for op in args.ops.split(","):
            spec = OPERATORS[op]()
            _log(f"{spec.name}: tuning ours, {args.trials} trials for every T in 1..512")
            tuned = tune_ours(spec, target, space, cores, args.trials, Path(scratch))
            ours_tuning += tuned.wall_s
            ms_latency, ms_wall = {}, float("nan")
            if not args.skip_metaschedule:
                _log(f"{spec.name}: MetaSchedule, {args.trials} trials over {len(METASCHEDULE_LENGTHS)} static T")
                ms_latency, ms_wall = baselines.tune_metaschedule(
                    spec, METASCHEDULE_LENGTHS, target, args.trials, Path(scratch) / f"ms-{op}")
                ms_tuning += ms_wall
            print(f"\n{spec.name} on {args.target}: ours tuned in {tuned.wall_s:.0f} s ({tuned.trials} trials, "
                  f"{len(tuned.plan.variants)} variants); MetaSchedule {ms_wall:.0f} s for {len(ms_latency)} shapes")
            print(f"{'T':>5} {'ours ms':>9} {'torch ms':>9} {'numpy ms':>9} {'default ms':>11} {'MS ms':>9} "
                  f"{'vs torch':>9} {'vs numpy':>9} {'vs default':>11} {'vs MS':>7}")
            for length in lengths:
                ours = time_ours(spec, tuned.plan, target, length)
                # PyTorch at its better thread count: with 2 threads on a shared 2-core VM a
                # call can wait a whole scheduler slice (~8 ms), which is not PyTorch's cost.
                torch_s = baselines.time_torch(spec, {"T": length}, device=device)
                if device == "cpu":
                    torch_s = min(torch_s, baselines.time_torch(spec, {"T": length}, threads=1))
                    torch.set_num_threads(len(os.sched_getaffinity(0)))
                numpy_s = baselines.time_numpy(spec, {"T": length}) if device == "cpu" else float("nan")
                default_s = (float("nan") if args.skip_default else
                             baselines.time_tvm_default(spec, {"T": length}, target, time_cap_s=6))
                ms_s = ms_latency.get(length)
                vs_torch.append(torch_s / ours)
                if ms_s:
                    vs_ms.append(ms_s / ours)
                ms_text = f"{ms_s * 1e3:9.3f}" if ms_s else f"{'-':>9}"
                ms_ratio = f"{ms_s / ours:7.2f}" if ms_s else f"{'-':>7}"
                print(f"{length:5d} {ours * 1e3:9.3f} {torch_s * 1e3:9.3f} {numpy_s * 1e3:9.3f} "
                      f"{default_s * 1e3:11.3f} {ms_text} {torch_s / ours:9.2f} {numpy_s / ours:9.2f} "
                      f"{default_s / ours:11.1f} {ms_ratio}", flush=True)
    ratio = ms_tuning / ours_tuning if ms_tuning else float("nan")
    print(f"\ntuning wall time: ours {ours_tuning:.0f} s (every T in 1..512), MetaSchedule {ms_tuning:.0f} s "
          f"({len(METASCHEDULE_LENGTHS)} static T per operator; covering all {len(lengths)} benchmark T would "
          f"take ~{ms_tuning * len(lengths) / len(METASCHEDULE_LENGTHS):.0f} s)")
    print(f"RESULT geomean_vs_torch={geomean(vs_torch):.3f} min_vs_torch={min(vs_torch):.3f} "
          f"geomean_vs_metaschedule={geomean(vs_ms):.3f} tuning_time_ratio={ratio:.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    sys.exit(main())
