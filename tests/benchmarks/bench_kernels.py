"""BERT-base's dynamic operators across sequence lengths: our DietCode-tuned kernels (one tuning
run per operator covering every T in 1..512) beside PyTorch (oneDNN / MKL), numpy (OpenBLAS),
the model's default CPU rule (what linking a plan replaces) and MetaSchedule tuned per static
shape (64 trials on each of 6 T by default), with the machine's ceiling measured in the same run
(numpy sgemm on 2048^3, and a read-only pass over a weight-sized array for T = 1).

    python tests/benchmarks/bench_kernels.py [--trials 64] [--ms-trials 64] [--ms-lengths 1,64,512]
                                             [--ops dense_768x3072,attention_scores]
                                             [--target llvm|cuda] [--mcpu znver3] [--skip-metaschedule]
                                             [--save-plans DIR]
                                             [--load-plans DIR] [--reference PATH] [--rounds 5]

Per operator it prints the plan's variants and a table of latency, GFLOP/s and % of the sgemm
ceiling per T with ratios (>1: ours faster); the last line is ``RESULT geomean_vs_torch=X
min_vs_torch=Y geomean_vs_metaschedule=Z tuning_time_ratio=W ceiling_pct_t64plus=P``: torch and
MetaSchedule latency over ours (geomean over every operator and T, min over them), MetaSchedule's
tuning wall time over ours, and the geomean % of the sgemm ceiling the dense layers reach at
T >= 64. Not a test: run it on an idle machine.

``--precision bf16`` (CPUs with AVX512-BF16): the dense layers with bf16 products (attention's
stay fp32), beside PyTorch's bf16 matmul, with the bf16 peak (``vdpbf16ps`` in registers on every
core) measured beside the FMA peak; ``RESULT`` adds ``bf16_peak_pct_t64plus``: the dense layers'
geomean share of the bf16 peak at T >= 64. On a CPU with AMX-BF16 tiles the space holds AMX
kernels too, the AMX peak (``tdpbf16ps`` on tiles, every core) is measured beside, and ``RESULT``
adds ``amx_peak_pct_t64plus``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_baselines as baselines  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402
from timing import geomean  # noqa: E402

from dietserve.kernels.decision_tree_func import dispatched_prim_func  # noqa: E402
from dietserve.kernels.plan.kernel_plan import KernelPlan  # noqa: E402
from dietserve.kernels.tir.build import build  # noqa: E402
from tuner.database.records import RecordDatabase  # noqa: E402
from tuner.measure.runner import LocalRunner, MeasureOptions  # noqa: E402
from tuner.measure.timing import TimingPolicy  # noqa: E402
from tuner.ops import attention_context, attention_scores, dense  # noqa: E402
from tuner.targets import resolve_target  # noqa: E402
from tuner.task import ShapeVar, TuningTask  # noqa: E402
from tuner.tune import (  # noqa: E402
    TuneOptions,
    Tuner,  # noqa: E402
    TuneResult,
)

LENGTHS = [1, 2, 7, 13, 31, 64, 97, 127, 128, 129, 200, 257, 300, 384, 449, 512]  # 16, with primes
METASCHEDULE_LENGTHS = [1, 13, 64, 128, 300, 512]
OPERATORS = {  # BERT-base's dynamic operators, with the epilogues the model fuses into them
    "dense_768x2304": lambda p="fp32": dense(768, 2304, "bias", p),  # query, key and value, side by side
    "dense_768x768_residual": lambda p="fp32": dense(768, 768, "bias_residual", p),  # attention output
    "dense_768x3072": lambda p="fp32": dense(768, 3072, "bias_gelu", p),  # intermediate
    "dense_3072x768": lambda p="fp32": dense(3072, 768, "bias_residual", p),  # output
    "attention_scores": lambda p="fp32": attention_scores(12, 64),
    "attention_context": lambda p="fp32": attention_context(12, 64),
}
# Before the model computed query, key and value in one layer, each was a 768 -> 768 layer of
# its own: kept for ``cold_weights.py`` and to compare with earlier measurements (``--ops``).
OPERATORS["dense_768x768"] = lambda p="fp32": dense(768, 768, "bias", p)
MODEL_OPERATORS = [op for op in OPERATORS if op != "dense_768x768"]


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def tune_ours(spec, target: dict, space: list, cores: int, trials: int, folder: Path, hardware=None):
    """``hardware``: the CPU's description, as the command line gives it (the L2 a task block
    must fit at the weight's own depth: ``task_space``)."""
    task = TuningTask.create(spec, target, ShapeVar("T", range(1, 513)))
    database = RecordDatabase(folder / f"{spec.name}.jsonl")
    with LocalRunner(MeasureOptions(timing=TimingPolicy(number=2, repeat=3), timeout_s=60)) as runner:
        result = Tuner(task, space, cores, runner, database, TuneOptions(trials=trials), hardware=hardware).run()
    return result


def compile_ours(spec, plan, target: dict):
    host = target.get("host")
    device_target = {k: v for k, v in target.items() if k != "host"}
    tvm_target = tvm.target.Target(device_target, host=host) if host else tvm.target.Target(device_target)
    return build(dispatched_prim_func(spec.func, plan, tvm_target), tvm_target).jit()


def time_ours(spec, plan, lib, target: dict, length: int) -> float:
    device = tvm.cuda(0) if target["kind"] == "cuda" else tvm.cpu(0)
    args, inputs = baselines.tvm_arguments_packed(spec, {"T": length}, device, plan.pack)
    lib["main"](*args)
    baselines.check_against_reference(spec, args[-1].numpy(), inputs)
    return baselines.time_tvm_module(lib, args, device, repeat=7, time_cap_s=10)


def hand_reference(path: Path):
    """T -> seconds of the hand-scheduled dense 768->3072 + bias + GELU kernel in ``path``
    (``../shared/reference/dense_gelu_avx2.py``: its own packing, schedule and erf
    approximation, symbolic in T), timed like ours; built once."""
    import importlib.util

    loaded = importlib.util.spec_from_file_location("hand_reference", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    lib = tvm.compile(module.build_module(), target=module.TGT).jit()
    rng = np.random.default_rng(0)
    device = tvm.cpu(0)
    weight = tvm.runtime.tensor(module.pack_weight(rng.standard_normal((module.N, module.K), np.float32) * 0.05))
    bias = tvm.runtime.tensor(rng.standard_normal(module.N, np.float32) * 0.5)

    def time_reference(length: int) -> float:
        x = tvm.runtime.tensor(rng.standard_normal((length, module.K), np.float32))
        y = tvm.runtime.empty((length, module.N), "float32", device)
        return baselines.time_tvm_module(lib, [x, weight, bias, y], device, func_name="dense_gelu", repeat=7,
                                         time_cap_s=10)

    return time_reference


def interleaved(timers: dict, rounds: int, pause_s: float = baselines.SETTLE_S) -> dict:
    """Median over ``rounds`` of each timer (``timers``: point -> method -> timer), a round
    running every point's methods in turn, each after a pause. Another library's spinning
    worker threads (OpenMP, OpenBLAS, TVM's pool) steal the cores for a while after its last
    call, and this shared machine has slow spells lasting seconds (a neighbour on the host):
    spreading a point's rounds over the whole table keeps one spell from deciding a point, and
    no method gets a quiet or a noisy spell to itself."""
    samples = {point: {name: [] for name in methods} for point, methods in timers.items()}
    for _ in range(rounds):
        for point, methods in timers.items():
            for name, timer in methods.items():
                time.sleep(pause_s)
                samples[point][name].append(timer())
    return {point: {name: statistics.median(values) for name, values in methods.items()}
            for point, methods in samples.items()}


def _cell(value: float | None, fmt: str, width: int) -> str:
    return f"{value:{width}{fmt}}" if value is not None and math.isfinite(value) else f"{'-':>{width}}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=64, help="our trials per operator (all of T in 1..512)")
    parser.add_argument("--ms-trials", type=int, default=64, help="MetaSchedule's trials per static shape")
    parser.add_argument("--ms-lengths", default=",".join(map(str, METASCHEDULE_LENGTHS)),
                        help="the static T MetaSchedule tunes")
    parser.add_argument("--ops", default=",".join(MODEL_OPERATORS), help=f"comma-separated subset of {list(OPERATORS)}")
    parser.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    parser.add_argument("--mcpu", help="llvm: the CPU to build and tune for (default this one's), e.g. znver3 for "
                                       "AVX2 code on an AVX-512 machine; every TVM baseline is built for it too")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--skip-metaschedule", action="store_true")
    parser.add_argument("--skip-default", action="store_true", help="skip the model's default rule")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds over the whole table of T (median per point reported; default 5)")
    parser.add_argument("--save-plans", type=Path, help="write each operator's tuned plan here (to rerun a point)")
    parser.add_argument("--reference", type=Path,
                        help="the hand-scheduled dense+GELU kernel (../shared/reference/dense_gelu_avx2.py): "
                             "timed beside dense_768x3072 in the same rounds")
    parser.add_argument("--load-plans", type=Path,
                        help="time the plans a --save-plans run wrote instead of tuning (a fresh process's "
                             "timings of the same kernels; tuning time is then not measured)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: the dense layers with bf16 products, beside PyTorch's bf16 matmul and the bf16 "
                             "peak (CPUs with AVX512-BF16; attention stays fp32)")
    args = parser.parse_args()
    if args.precision == "bf16":
        if args.ops == parser.get_default("ops"):
            args.ops = ",".join(op for op in MODEL_OPERATORS if op.startswith("dense"))
        args.skip_metaschedule = True  # (its static operators are fp32: no bf16 baseline to tune)
    lengths = [int(v) for v in args.lengths.split(",")]
    ms_lengths = [int(v) for v in args.ms_lengths.split(",")]
    where = resolve_target(args.target, mcpu=args.mcpu)
    target, space, cores = where.target, where.space, where.cores
    on_cpu = args.target == "llvm"
    if on_cpu:
        # TVM kernels timed here get every core, as the served model's do (TVM's default pool has
        # half the cores on x86: earlier runs timed every TVM kernel on one core of two).
        from dietserve.host.cpu import configure_cpu_threads

        configure_cpu_threads(cores)
    device = "cuda" if args.target == "cuda" else "cpu"
    sgemm, stream = baselines.machine_ceiling(target) if on_cpu else (float("nan"), float("nan"))
    fma = baselines.fma_peak_rate(target) if on_cpu else float("nan")
    bf16 = args.precision == "bf16"
    dots = baselines.bf16_peak_rate(target) if bf16 else float("nan")
    tiles = bf16 and on_cpu and where.hardware.matrix_tiles  # (AMX kernels are then in the space)
    amx_peak = baselines.amx_peak_rate(target) if tiles else float("nan")
    _log(f"ceiling at start: numpy sgemm 2048^3 {sgemm:.1f} GFLOP/s, FMA peak {fma:.1f} GFLOP/s, read-only weight "
         f"pass {stream:.1f} GB/s" + (f", bf16 peak {dots:.1f} GFLOP/s" if bf16 else "")
         + (f", AMX peak {amx_peak:.1f} GFLOP/s" if tiles else ""))
    vs_torch, vs_ms, ours_tuning, ms_tuning, ceiling_points, dense_rates = [], [], 0.0, 0.0, [], []
    streaming, references = [], []
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as scratch:
        for op in args.ops.split(","):
            spec = OPERATORS[op](args.precision)
            if args.load_plans:
                tuned = TuneResult(KernelPlan.read(args.load_plans / f"{op}.plan.json"), 0, 0, float("nan"))
                _log(f"{spec.name}: the plan {args.load_plans / f'{op}.plan.json'}, not tuned again")
            else:
                _log(f"{spec.name}: tuning ours, {args.trials} trials for every T in 1..512")
                # (with the CPU's description, as ``python -m tuner`` tunes: without it, 1.5 MB
                # whole-reduction tasks of the 3072-deep layer stayed in the space)
                tuned = tune_ours(spec, target, space, cores, args.trials, Path(scratch), where.hardware)
            ours_tuning += tuned.wall_s
            if args.save_plans:
                tuned.plan.write(args.save_plans / f"{op}.plan.json")
            ms_latency, ms_wall = {}, float("nan")
            if not args.skip_metaschedule:
                _log(f"{spec.name}: MetaSchedule, {args.ms_trials} trials on each of {len(ms_lengths)} static T")
                ms_latency, ms_wall = baselines.tune_metaschedule(
                    spec, ms_lengths, target, args.ms_trials, Path(scratch) / f"ms-{op}")
                ms_tuning += ms_wall
            rows = []
            lib = compile_ours(spec, tuned.plan, target)
            timers, reference = {}, None
            for length in lengths:
                shape = {"T": length}
                # PyTorch at its better thread count: with as many threads as a shared host has
                # cores, a call can wait a whole scheduler slice, which is not PyTorch's cost.
                timers[length] = {"ours": partial(time_ours, spec, tuned.plan, lib, target, length),
                                  "torch": partial(_best_torch, spec, shape, device)}
                if on_cpu:
                    timers[length]["numpy"] = partial(baselines.time_numpy, spec, shape)
                    if args.reference and op == "dense_768x3072":
                        reference = reference or hand_reference(args.reference)
                        timers[length]["reference"] = partial(reference, length)
                    if not args.skip_default:
                        timers[length]["default"] = partial(baselines.time_default_rule, spec, shape, target)
            _log(f"{spec.name}: timing {len(lengths)} T x {len(timers[lengths[0]])} methods, {args.rounds} rounds")
            by_length = interleaved(timers, args.rounds)
            for length in lengths:
                times = by_length[length]
                ours, torch_s = times["ours"], times["torch"]
                numpy_s, default_s = times.get("numpy", float("nan")), times.get("default", float("nan"))
                ms_s = ms_latency.get(length)
                gflops = spec.flops({"T": length}) / ours / 1e9
                vs_torch.append(torch_s / ours)
                if ms_s:
                    vs_ms.append(ms_s / ours)
                if spec.kind == "dense" and length >= 64:
                    ceiling_points.append(gflops / sgemm)
                    dense_rates.append(gflops)
                if spec.kind == "dense" and length == 1:
                    weight_bytes = (2 if bf16 else 4) * math.prod(random_shape(spec))
                    # A read-only pass over as many bytes pays the same call and thread wake-up
                    # cost, which a small weight's read time does not hide.
                    same_size = baselines.read_rate(target, max(1, weight_bytes // baselines.PANEL_BYTES))
                    streaming.append((spec.name, weight_bytes / ours / 1e9, same_size))
                rows.append((length, ours, gflops, torch_s, numpy_s, default_s, ms_s))
                if "reference" in times:
                    references.append((length, times["reference"], ours))
            results.append((spec, tuned, ms_wall, len(ms_latency), rows))
            _print_table(spec, tuned, ms_wall, len(ms_latency), args.ms_trials, rows, sgemm, args.target)
    sgemm_end, stream_end = baselines.machine_ceiling(target) if on_cpu else (float("nan"), float("nan"))
    fma_end = baselines.fma_peak_rate(target) if on_cpu else float("nan")
    dots_end = baselines.bf16_peak_rate(target) if bf16 else float("nan")
    amx_end = baselines.amx_peak_rate(target) if tiles else float("nan")
    _log(f"ceiling at end: numpy sgemm {sgemm_end:.1f} GFLOP/s, FMA peak {fma_end:.1f} GFLOP/s, read-only pass "
         f"{stream_end:.1f} GB/s" + (f", bf16 peak {dots_end:.1f} GFLOP/s" if bf16 else ""))
    ratio = ms_tuning / ours_tuning if ms_tuning else float("nan")
    print(f"\nceiling (same run, start / end): numpy sgemm 2048^3 {sgemm:.1f} / {sgemm_end:.1f} GFLOP/s; "
          f"FMA peak (multiply-adds in registers, every core) {fma:.1f} / {fma_end:.1f} GFLOP/s; "
          f"read-only pass over a 768x3072 weight {stream:.1f} / {stream_end:.1f} GB/s")
    if bf16:
        print(f"bf16 peak (vdpbf16ps in registers, every core; start / end): {dots:.1f} / {dots_end:.1f} GFLOP/s")
    if tiles:
        print(f"AMX peak (tdpbf16ps on tiles, every core; start / end): {amx_peak:.1f} / {amx_end:.1f} GFLOP/s")
    if dense_rates:
        peak, name = (max(dots, dots_end), "bf16 peak") if bf16 else (max(fma, fma_end), "FMA peak")
        print(f"dense layers at T >= 64: {min(dense_rates):.1f}-{max(dense_rates):.1f} GFLOP/s, geomean "
              f"{geomean(dense_rates):.1f} = {100 * geomean(dense_rates) / peak:.1f}% of the {name}")
    for name, rate, same_size in streaming:
        print(f"T=1 weight streaming, {name}: {rate:.1f} GB/s = {rate / max(stream, stream_end):.2f} of the "
              f"read-only pass over a 768x3072 weight, {rate / same_size:.2f} of one over as many bytes "
              f"({same_size:.1f} GB/s)")
    for length, reference_s, ours in references:
        print(f"hand reference, dense 768->3072 + GELU, T={length}: {reference_s * 1e3:.3f} ms, ours "
              f"{ours * 1e3:.3f} ms: ours {reference_s / ours:.2f}x the reference")
    if references:
        print(f"vs the hand reference: geomean {geomean([r / o for _, r, o in references]):.2f}x, min "
              f"{min(r / o for _, r, o in references):.2f}x")
    print(f"tuning wall time: ours {ours_tuning:.0f} s ({args.trials} trials per operator, every T in 1..512), "
          f"MetaSchedule {ms_tuning:.0f} s ({args.ms_trials} trials on each of {len(ms_lengths)} static T per "
          f"operator)")
    ceiling_pct = 100 * geomean(ceiling_points) * sgemm / max(sgemm, sgemm_end) if ceiling_points else float("nan")
    print(f"RESULT geomean_vs_torch={geomean(vs_torch):.3f} min_vs_torch={min(vs_torch):.3f} "
          f"geomean_vs_metaschedule={geomean(vs_ms):.3f} tuning_time_ratio={ratio:.2f} "
          f"ceiling_pct_t64plus={ceiling_pct:.1f}"
          + (f" bf16_peak_pct_t64plus={100 * geomean(dense_rates) / max(dots, dots_end):.1f}" if bf16 else "")
          + (f" amx_peak_pct_t64plus={100 * geomean(dense_rates) / max(amx_peak, amx_end):.1f}" if tiles else ""))
    return 0


def _best_torch(spec, shape: dict, device: str) -> float:
    best = baselines.time_torch(spec, shape, device=device)
    if device == "cpu":
        best = min(best, baselines.time_torch(spec, shape, threads=1))
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    return best


def random_shape(spec) -> tuple[int, int]:
    """(K, N) of a dense operator's weight."""
    return spec.input_shapes({"T": 1})[1]


def _print_table(spec, tuned, ms_wall, ms_shapes, ms_trials, rows, sgemm, target) -> None:
    packed = f", weights packed in panels of {tuned.plan.pack}" if tuned.plan.pack else ""
    print(f"\n{spec.name} on {target}: ours tuned in {tuned.wall_s:.0f} s ({tuned.trials} trials, "
          f"{len(tuned.plan.variants)} variants{packed}); MetaSchedule {ms_wall:.0f} s for {ms_shapes} shapes, "
          f"{ms_trials} trials each")
    for name in tuned.plan.variants:
        print(f"  {name}: {tuned.plan.kernel(name) or 'default rule'}")
    print(f"{'T':>5} {'ours ms':>9} {'GFLOP/s':>8} {'%ceil':>6} {'torch ms':>9} {'numpy ms':>9} {'default ms':>11} "
          f"{'MS ms':>9} {'vs torch':>9} {'vs numpy':>9} {'vs default':>11} {'vs MS':>7}")
    for length, ours, gflops, torch_s, numpy_s, default_s, ms_s in rows:
        print(f"{length:5d} {ours * 1e3:9.3f} {gflops:8.1f} {100 * gflops / sgemm:6.1f} {torch_s * 1e3:9.3f} "
              f"{_cell(numpy_s * 1e3, '.3f', 9)} {_cell(default_s * 1e3, '.3f', 11)} "
              f"{_cell(ms_s * 1e3 if ms_s else None, '.3f', 9)} {torch_s / ours:9.2f} "
              f"{_cell(numpy_s / ours, '.2f', 9)} {_cell(default_s / ours, '.2f', 11)} "
              f"{_cell(ms_s / ours if ms_s else None, '.2f', 7)}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    sys.exit(main())
