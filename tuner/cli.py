"""Command line of the tuner, usable without the server. ``tune-tasks`` is how ``python -m
dietserve tune`` hands over a model's operators: a task file in, one kernel plan per task out.

    python -m tuner tune --op dense --k 768 --n 3072 --t 1:512 --target llvm --trials 256 --db records.jsonl
    python -m tuner tune-tasks --tasks tasks.json --db records.jsonl --plans DIR --trials 64
    python -m tuner bundle export|import ...   (a GPU host no network reaches: measure/bundle.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import tvm

from dietserve.host.cpu import target_cores
from dietserve.host.hardware import GPU_PRESETS, last_level_cache_bytes
from dietserve.kernels.cpu_packed.packing import with_precision
from dietserve.kernels.plan.attention_plan import AttentionPlan, attention_plan_path
from dietserve.kernels.plan.kernel_plan import PRECISIONS, KernelPlan, PlanError, plan_path
from dietserve.kernels.plan.task_file import AttentionTask, TaskFile
from dietserve.kernels.space import task_space

from .attention import task_digest, tune_attention
from .database.records import RecordDatabase
from .extract import spec_from_prim_func
from .measure.bundle import BundleRunner, import_results, write_bundle
from .measure.dram import dram_read_rate
from .measure.runner import LocalRunner, MeasureOptions, RPCRunner
from .measure.timing import TimingPolicy
from .ops import EPILOGUES, attention_context, attention_scores, dense
from .planning.weight_stream import DramRates
from .targets import resolve_target
from .task import ShapeVar, TuningTask
from .tune import TUNER_VERSION, TuneOptions, Tuner


def _say(message: str) -> None:
    print(f"[tuner] {message}", file=sys.stderr, flush=True)


def _spec(args: argparse.Namespace):
    if args.op == "dense":
        if args.k is None or args.n is None:
            raise SystemExit("--op dense needs --k and --n (the weight is [K, N])")
        return dense(args.k, args.n, args.epilogue, args.precision)
    builder = attention_scores if args.op == "attention_scores" else attention_context
    return builder(args.heads, args.head_dim, args.batch)


def _timing(args: argparse.Namespace) -> TimingPolicy:
    return TimingPolicy(number=args.number, repeat=args.repeat, min_repeat_ms=args.min_repeat_ms,
                        cpu_turns=args.cpu_turns)


def _measure_options(args: argparse.Namespace) -> MeasureOptions:
    return MeasureOptions(timing=_timing(args), timeout_s=args.timeout, workers=args.workers).for_trials(args.trials)


def _runner(args: argparse.Namespace) -> LocalRunner:
    options = _measure_options(args)
    return RPCRunner(args.rpc_tracker, args.rpc_key, options) if args.rpc_tracker else LocalRunner(options)


def _dram_rates(args: argparse.Namespace, where):
    """The machine's DRAM read rates, measured here, for plans that rank dense kernels as served
    (``weight_stream``); None where the kernels are timed elsewhere (RPC), on a GPU, or
    ``--plan-weights cache``."""
    if args.plan_weights == "cache" or args.rpc_tracker or where.target.get("kind") != "llvm":
        return None
    cache = last_level_cache_bytes()
    rates = DramRates(every_core=dram_read_rate(where.cores, cache), one_core=dram_read_rate(1, cache))
    _say(f"DRAM read rate {rates.every_core / 1e9:.1f} GB/s on {where.cores} cores, {rates.one_core / 1e9:.1f} on one:"
         " plans rank dense kernels with their weight read from DRAM")
    return rates


def _tuner(args: argparse.Namespace, task: TuningTask, where, runner, time_budget_s: float | None,
           dram: DramRates | None, **rounds) -> Tuner:
    options = TuneOptions(trials=args.trials, time_budget_s=time_budget_s, max_variants=args.max_variants,
                          loop_partition=args.loop_partition, seed=args.seed, dram=dram, **rounds)
    return Tuner(task, where.space, where.cores, runner, RecordDatabase(Path(args.db)), options,
                 log=_say if args.verbose else lambda _message: None, hardware=where.hardware)


def _weights(path: str | None, variable: ShapeVar) -> list[float] | None:
    """``--weights FILE``: JSON {value: weight}; values it does not name get weight 0."""
    if path is None:
        return None
    raw = json.loads(Path(path).read_text())
    return [float(raw.get(str(value), 0.0)) for value in variable.values]


def cmd_tune(args: argparse.Namespace) -> int:
    variable = ShapeVar.parse("T", args.t)
    where = resolve_target(args.target, args.gpu, args.cores, args.mcpu, args.sm_count)
    if args.op == "varlen_attention":
        return _tune_attention_op(args, variable, where)
    spec = _spec(args)
    task = TuningTask.create(spec, where.target, variable, _weights(args.weights, variable))
    dram = _dram_rates(args, where)
    runner = _runner(args)
    _say(f"{task.workload}: {len(task.instances)} shapes ({variable.values[0]}..{variable.values[-1]}), "
         f"{len(task_space(where.space, spec.func, where.hardware))} micro-kernels for {where.hardware.name}, "
         f"{args.trials} trials, measuring on {runner.describe()}")
    with runner:
        result = _tuner(args, task, where, runner, args.time_budget, dram).run()
    written = result.plan.write(Path(args.plan) if args.plan else Path(args.db).with_suffix(".plan.json"))
    _say(f"{result.trials} trials ({result.failures} failed) in {result.wall_s:.1f} s; "
         f"{len(result.plan.variants)} variants; plan written to {written}")
    for name in result.plan.variants:
        _say(f"  {name}: {result.plan.kernel(name)}")
    return 0


def _tune_attention_op(args: argparse.Namespace, variable: ShapeVar, where) -> int:
    """``tune --op varlen_attention``: the packed attention kernel over sequence lengths 1..max(T),
    weighted by ``--weights`` (lengths ``--t`` does not list weigh nothing)."""
    if where.target["kind"] != "llvm":
        raise ValueError("the packed attention kernel is a CPU (llvm) kernel")
    max_len = max(variable.values)
    weights = _weights(args.weights, variable) or [1.0] * len(variable.values)
    by_length = dict(zip(variable.values, weights, strict=True))
    per_length = [by_length.get(n, 0.0) for n in range(1, max_len + 1)]
    uniform = args.weights is None and len(by_length) == max_len  # every length alike: no weights
    task = AttentionTask(args.heads, args.head_dim, max_len, [] if uniform else per_length)
    out = Path(args.plan) if args.plan else attention_plan_path(Path(args.db).parent, args.heads, args.head_dim)
    timing = _timing(args)
    plan = tune_attention(task, where.target, where.hardware, where.cores, timing, str(tvm.__version__),
                          TUNER_VERSION, timeout_s=10 * args.timeout, say=_say, precision=args.precision)
    _say(f"attention plan written to {plan.write(out)}: {', '.join(plan.tiles)}")
    return 0


def _target_for(description: dict):
    if description.get("kind") == "cuda":
        presets = {hw.arch: name for name, hw in GPU_PRESETS.items()}
        arch = description.get("arch")
        if arch not in presets:
            raise ValueError(f"no GPU preset for {arch!r}; known: {sorted(presets)}")
        return resolve_target("cuda", presets[arch])
    return resolve_target("llvm", cores=target_cores(description), mcpu=description.get("mcpu"))


def _plan_is_current(path: Path, workload: str, target: dict, trials: int, softmax: bool = False,
                     precision: str = "fp32") -> bool:
    if not path.exists():
        return False
    try:
        plan = KernelPlan.read(path)
        plan.check_target(target, str(tvm.__version__))
        plan.check_precision(precision)
        if plan.workload != workload:
            raise PlanError(f"{path} is for workload {plan.workload}, not {workload}")
    except PlanError as err:
        _say(f"re-tuning: {err}")
        return False
    if plan.provenance.get("tuner") != TUNER_VERSION:
        # A plan from another version of the search may rest on what it got wrong.
        _say(f"re-tuning: {path} was made by tuner version {plan.provenance.get('tuner')}, this is {TUNER_VERSION}")
        return False
    if plan.provenance.get("softmax", False) != softmax:
        _say(f"re-tuning: {path} was timed {'without' if softmax else 'with'} the fused softmax it is now served "
             f"{'with' if softmax else 'without'}")
        return False
    return plan.provenance.get("trials_requested", 0) >= trials


def _model_task(description, where, precision: str = "fp32") -> TuningTask:
    """The task of one of a task file's operators; a dense layer of a bf16 build times bf16 kernels."""
    func = with_precision(tvm.ir.load_json(description.func), precision)
    spec = spec_from_prim_func("matmul", func, row_softmax=description.softmax)
    variable = ShapeVar(description.vary["var"], description.vary["values"])
    return TuningTask.create(spec, where.target, variable, description.weights or None, description.fixed)


def _write_model_plan(result, description, tasks: TaskFile, args: argparse.Namespace) -> Path:
    """The tune's plan under the model's workload key (computed on its own PrimFunc, not ours of
    the copy), with what it was tuned from, for the task file's precision (an operator without
    a weight computes fp32 in a bf16 build, and its plan is that build's all the same)."""
    provenance = {**result.plan.provenance, "trials_requested": args.trials, "records": str(Path(args.db).resolve()),
                  "model": tasks.model, "softmax": description.softmax}
    plan = dataclasses.replace(result.plan, workload=description.workload, operator=description.operator,
                               provenance=provenance, precision=tasks.precision)
    return plan.write(plan_path(Path(args.plans), description.workload))


def cmd_tune_tasks(args: argparse.Namespace) -> int:
    tasks = TaskFile.read(Path(args.tasks))
    where = _target_for(tasks.target)
    budget_each = args.time_budget / len(tasks.tasks) if args.time_budget else None
    started = time.monotonic()
    runner = _runner(args)
    _say(f"measuring on {runner.describe()}")
    dram = _dram_rates(args, where)
    with runner:
        for index, description in enumerate(tasks.tasks, 1):
            out = plan_path(Path(args.plans), description.workload)
            header = f"[{index}/{len(tasks.tasks)}] {description.operator} (x{description.calls} calls)"
            if _plan_is_current(out, description.workload, tasks.target, args.trials, description.softmax,
                                tasks.precision):
                _say(f"{header}: plan {out} is up to date")
                continue
            task = _model_task(description, where, tasks.precision)
            _say(f"{header}: {len(task.instances)} shapes of {task.dispatch_var}, {args.trials} trials"
                 + (", timed with its fused softmax" if description.softmax else ""))
            tuner = _tuner(args, task, where, runner, budget_each, dram)
            result = tuner.run()
            plan = KernelPlan.read(_write_model_plan(result, description, tasks, args))
            chosen = ", ".join(f"{name}={plan.kernel(name) or 'default rule'}" for name in plan.variants)
            _say(f"{header}: {result.trials} trials ({tuner.reused} reused records) in "
                 f"{result.wall_s:.1f} s -> {out.name}: {chosen}")
    if tasks.attention is not None and where.target["kind"] == "llvm":
        _tune_attention_task(tasks.attention, where, args, tasks.precision)
    _say(f"tuned {len(tasks.tasks)} operators in {time.monotonic() - started:.1f} s")
    return 0


def _tune_attention_task(task: AttentionTask, where, args: argparse.Namespace, precision: str) -> None:
    """The packed attention kernel's tiles, re-timed unless a current plan was timed for the
    same task (length weights, kernels) and precision."""
    out = attention_plan_path(Path(args.plans), task.heads, task.head_dim)
    try:
        plan = AttentionPlan.read(out) if out.exists() else None
        if plan is not None:
            plan.check_target(where.target, str(tvm.__version__))
            plan.check_precision(precision)
    except PlanError as err:
        _say(f"re-tuning the attention kernel: {err}")
        plan = None
    if plan is not None and plan.provenance.get("tuner") == TUNER_VERSION \
            and plan.provenance.get("task_digest") == task_digest(task):
        _say(f"attention: plan {out} is up to date")
        return
    _say(f"attention ({task.heads} heads of {task.head_dim}): timing its register tiles over the "
         f"{'observed' if task.weights else 'uniform'} sequence lengths 1..{task.max_len}")
    timing = _timing(args)
    try:
        plan = tune_attention(task, where.target, where.hardware, where.cores, timing, str(tvm.__version__),
                              TUNER_VERSION, timeout_s=10 * args.timeout, say=_say, precision=precision)
    except (RuntimeError, PlanError) as err:  # the model still builds, on the hardware's tile
        _say(f"attention: not tuned: {err}")
        return
    _say(f"attention: {plan.provenance['seconds']} s -> {plan.write(out).name}")


def cmd_bundle_export(args: argparse.Namespace) -> int:
    """One round of every unfinished task's tune, into a bundle for a GPU host (``measure/bundle.py``)."""
    tasks = TaskFile.read(Path(args.tasks))
    where = _target_for(tasks.target)
    if where.target["kind"] != "cuda":
        raise ValueError("bundles carry CUDA candidates; this task file is for a CPU (tune it with tune-tasks)")
    database, runner, pending = RecordDatabase(Path(args.db)), BundleRunner(), []
    round_trials = args.round_trials or max(1, args.trials // 2)
    for description in tasks.tasks:
        out = plan_path(Path(args.plans), description.workload)
        if _plan_is_current(out, description.workload, tasks.target, args.trials, description.softmax,
                            tasks.precision):
            continue
        task, first = _model_task(description, where, tasks.precision), len(runner.jobs)
        result = _tuner(args, task, where, runner, None, None, resume=True, round_trials=round_trials).run()
        if len(runner.jobs) > first:
            pending.append((task, runner.jobs[first:]))
        else:
            _say(f"{description.operator}: tuned, plan {_write_model_plan(result, description, tasks, args)}")
    if not pending:
        _say(f"every plan is written to {args.plans}: nothing to measure")
        return 0
    count = write_bundle(Path(args.out), pending, database, say=_say)
    _say(f"bundle {args.out}: {count} candidates of {len(pending)} operators. On the GPU host: "
         f"python3 {args.out}/run.py --out RESULTS; then python -m tuner bundle import --bundle {args.out} "
         f"--results RESULTS --db {args.db}, and export again")
    return 0


def cmd_bundle_import(args: argparse.Namespace) -> int:
    imported, missing = import_results(Path(args.bundle), Path(args.results), RecordDatabase(Path(args.db)))
    _say(f"imported {imported} results into {args.db}"
         + (f"; {missing} jobs of the bundle have none yet (run it again on the GPU host)" if missing else ""))
    return 0


def _add_tune_flags(parser: argparse.ArgumentParser) -> None:
    """Flags ``tune`` and ``tune-tasks`` share: the plan's size, where and how candidates are timed."""
    parser.add_argument("--max-variants", type=int, default=4, help="micro-kernels per plan besides the default")
    parser.add_argument("--rpc-tracker", help="host:port of a TVM RPC tracker to measure on remote devices")
    parser.add_argument("--rpc-key", default="local", help="device key registered with the tracker")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per candidate before it is killed")
    parser.add_argument("--number", type=int, default=2, help="runs per timed repeat")
    parser.add_argument("--repeat", type=int, default=3, help="timed repeats (median kept)")
    parser.add_argument("--min-repeat-ms", type=int, default=10,
                        help="a timed repeat runs the kernel until it lasts this long (default 10)")
    parser.add_argument("--plan-weights", choices=["dram", "cache"], default="dram",
                        help="rank dense kernels in the plan with their weight read from DRAM, as served (default; "
                             "the DRAM rate is measured first), or as timed, the weight cached")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes building candidates in parallel (default: one per core, at most 4; "
                             "timings run one at a time)")
    parser.add_argument("--cpu-turns", metavar="LOCK_FILE",
                        help="time each candidate in a turn of the CPUs shared with a server through this lock file "
                             "(its batches and the timings alternate; the server's re-tuning job passes it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="log each failed candidate")


def _add_tune_parser(commands) -> None:
    tune = commands.add_parser("tune", help="tune one dynamic-shape operator for all its shapes")
    tune.add_argument("--op", choices=("dense", "attention_scores", "attention_context", "varlen_attention"),
                      required=True, help="varlen_attention: the packed attention kernel over sequence lengths")
    tune.add_argument("--k", type=int, help="dense: reduction size K")
    tune.add_argument("--n", type=int, help="dense: output features N")
    tune.add_argument("--epilogue", choices=EPILOGUES, default="bias", help="dense: fused epilogue (default bias)")
    tune.add_argument("--precision", choices=PRECISIONS, default="fp32",
                      help="dense, varlen_attention: the products' precision (bf16: CPUs with AVX512-BF16)")
    tune.add_argument("--heads", type=int, default=12, help="attention: heads (default 12)")
    tune.add_argument("--head-dim", type=int, default=64, help="attention: head size d (default 64)")
    tune.add_argument("--batch", type=int, default=1, help="attention: batch B (default 1)")
    tune.add_argument("--t", default="1:512", help="values of the symbolic T: 1:512, 1:512:8 or 1,7,128")
    tune.add_argument("--weights", help="JSON file {T: weight} (default: all T equally)")
    tune.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    tune.add_argument("--mcpu", help="llvm: CPU to compile for (default: this machine's)")
    tune.add_argument("--cores", type=int, help="llvm: cores to plan for (default: detected)")
    tune.add_argument("--gpu", choices=("h100", "t4"), default="h100", help="cuda: hardware preset")
    tune.add_argument("--sm-count", type=int, help="cuda: override the preset's SM count")
    tune.add_argument("--trials", type=int, default=256, help="micro-kernels to measure (default 256)")
    tune.add_argument("--time-budget", type=float, help="stop after this many seconds")
    tune.add_argument("--loop-partition", action="store_true", help="also partition boundary loops")
    tune.add_argument("--db", default="records.jsonl", help="records database (JSON lines, appended)")
    tune.add_argument("--plan", help="where to write the dispatch plan (default: DB with .plan.json; varlen_attention: "
                                     "varlen_attention[H=..,d=..].attention.json beside DB)")
    _add_tune_flags(tune)
    tune.set_defaults(run=cmd_tune)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tuner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_tune_parser(commands)
    model_tasks = commands.add_parser("tune-tasks", help="tune a model's operators from a task file "
                                                         "(written by python -m dietserve tune)")
    model_tasks.add_argument("--tasks", required=True, help="task description file (dietserve.tuning-tasks)")
    model_tasks.add_argument("--db", required=True, help="records database (JSON lines, appended, reused)")
    model_tasks.add_argument("--plans", required=True, help="directory for one <workload>.plan.json per task")
    model_tasks.add_argument("--trials", type=int, default=64, help="measurements per operator (default 64)")
    model_tasks.add_argument("--time-budget", type=float, help="seconds for all operators, split evenly")
    _add_tune_flags(model_tasks)
    model_tasks.set_defaults(run=cmd_tune_tasks, loop_partition=False)
    _add_bundle_parsers(commands)
    return parser


def _add_bundle_parsers(commands) -> None:
    bundle = commands.add_parser("bundle", help="tune a model's CUDA operators through files carried to a GPU host")
    actions = bundle.add_subparsers(dest="action", required=True)
    export = actions.add_parser("export", help="the next round's candidates, built, into a bundle")
    export.add_argument("--tasks", required=True, help="task description file (a CUDA target)")
    export.add_argument("--db", required=True, help="records database (JSON lines, appended, reused)")
    export.add_argument("--plans", required=True, help="directory for the finished plans")
    export.add_argument("--trials", type=int, default=64, help="measurements per operator in all (default 64)")
    export.add_argument("--round-trials", type=int, help="measurements per operator a round (default: half)")
    export.add_argument("--out", required=True, help="the bundle's folder (replaced)")
    export.add_argument("--max-variants", type=int, default=4, help="micro-kernels per plan besides the default")
    export.add_argument("--seed", type=int, default=0)
    export.set_defaults(run=cmd_bundle_export, loop_partition=False, verbose=False)
    imports = actions.add_parser("import", help="append a bundle's measured results to the records")
    imports.add_argument("--bundle", required=True, help="the bundle exported")
    imports.add_argument("--results", required=True, help="the folder (or results.jsonl) run.py wrote")
    imports.add_argument("--db", required=True, help="records database")
    imports.set_defaults(run=cmd_bundle_import)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as err:
        _say(f"error: {err}")
        return 2

