"""``python -m dietserve tune``: the model's dynamic operators out as tuning tasks, the tuner run
as its own process, its plans linked into a new artifact.

The serving side never imports the tuner: the task file goes out, plans come back
(``dietserve/kernels/plan/task_file.py``, ``plan.py``), and ``python -m tuner tune-tasks`` runs in a
child process, so the server installs and runs without the tuner's extras.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import tvm

from ..kernels.plan.attention_plan import attention_plan_path
from ..kernels.plan.decision_tree import names_in
from ..kernels.plan.kernel_plan import PLAN_SUFFIX, KernelPlan, plan_path, predicted_latency
from ..kernels.plan.task_file import TaskDescription, TaskFile, TuningError
from ..kernels.tir.matching import is_dynamic_matmul, matmul_axes, workload_key
from ..model.bert import PACKED_VARS, SHAPE_VARS
from ..model.presets import display_name
from ..runtime.manifest import LAYOUT_PACKED
from ..runtime.traffic import FORMAT as TRAFFIC_FORMAT
from ..runtime.traffic import Traffic, TrafficError, observed_lengths, observed_tokens
from ..runtime.variant_by_shape import dispatch_shape
from .artifact import compile_artifact, export_model
from .packed_attention import attention_task
from .passes.fuse_softmax import softmaxed_operators
from .passes.link_kernels import call_counts
from .pipeline import fast_math_passes, legalize_passes
from .request import CompileRequest, Progress, open_checkpoint
from .target import build_target, target_description

TASKS_FILE = "tasks.json"
PLANS_DIR = "plans"
ARTIFACT_DIR = "artifact"


@dataclass(frozen=True)
class TuneRequest:
    compile: CompileRequest
    db: Path
    out: Path
    trials: int = 64  # measurements per operator
    time_budget_s: float | None = None  # for all operators together
    lengths: tuple[int, ...] = ()  # observed sequence lengths (weights); empty: uniform over 1..max
    tokens: tuple[int, ...] = ()  # a packed model's observed tokens per execution; empty: as ``lengths``
    rpc_tracker: str | None = None  # host:port of a TVM RPC tracker: measure on its devices
    rpc_key: str = "local"  # the device key registered with the tracker
    # A lock file shared with a server on this machine: the tuner times in turns with its batches
    # (``host/cpu_turns.py``); None: timings take the CPUs as they find them.
    cpu_turns: Path | None = None

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"trials must be at least 1, got {self.trials}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time budget must be positive, got {self.time_budget_s}")


def read_observations(path: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(observed sequence lengths, a packed model's tokens per execution) from one file:
    whitespace-separated lengths, JSON ``{"length": count}``, or a server's traffic file
    (``runtime/traffic.py``: decayed rows per executed shape, and tokens per packed execution).
    Only a traffic file has token counts. A traffic file without rows (a server tuning before its
    first request) gives no lengths: every length alike."""
    text = Path(path).read_text()
    try:
        if text.lstrip().startswith("{"):
            counts = json.loads(text)
            if isinstance(counts, dict) and counts.get("format") == TRAFFIC_FORMAT:
                traffic = Traffic.from_dict(counts, str(path))
                lengths = observed_lengths(traffic)
                if not lengths:
                    return (), ()
                return _positive(lengths, path), observed_tokens(traffic)
            lengths = [int(length) for length, count in counts.items() for _ in range(int(count))]
        else:
            lengths = [int(token) for token in text.split()]
    except TrafficError:
        raise
    except (ValueError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: lengths must be integers, one per observation, or JSON {{length: count}}: "
                         f"{err}") from err
    return _positive(lengths, path), ()


def _positive(lengths, path: Path) -> tuple[int, ...]:
    if not lengths or min(lengths) < 1:
        raise ValueError(f"{path} holds no positive sequence lengths")
    return tuple(lengths)


# An operator whose rows do not depend on seq_len (the pooling sum has ``batch`` rows) is tuned
# over the batch sizes at this length.
POOLING_TUNE_LENGTH = 128


def tuning_tasks(request: CompileRequest, cache_dir: Path, lengths: Sequence[int] = (),
                 tokens: Sequence[int] = ()) -> TaskFile:
    """One task per distinct dynamic matmul-like workload of the model, varying ``seq_len`` over
    1..max length at batch 1 (dense layers see ``batch * seq_len`` rows, so batches reuse the
    plan; a packed model's see the tokens of a run, varied the same way and weighted by
    ``tokens``, the tokens per execution, where given), weighted by ``lengths`` where given;
    operators whose rows are ``batch`` alone vary the batch instead.
    On CPU an operator the link pass fuses with its softmax (attention's scores) is marked so,
    and the tuner times it with the softmax, as it is served. A packed model's attention kernel
    is a task of its own, over sequence lengths weighted by ``lengths``."""
    checkpoint = open_checkpoint(request, cache_dir)
    folder = checkpoint.folder
    target = build_target(request.target)
    mod, _ = export_model(checkpoint.model(), request, target)
    with target:
        legalized = tvm.transform.Sequential([*fast_math_passes(), *legalize_passes()])(mod)
    calls = call_counts(legalized)
    softmaxed = softmaxed_operators(legalized) if target.kind.name == "llvm" else set()
    max_len = checkpoint.config.max_length
    values = list(range(1, max_len + 1))
    weights = _weights(lengths, values)
    token_weights = _weights(tokens, values) if tokens else weights
    tasks: dict[str, TaskDescription] = {}
    for gvar, func in legalized.functions_items():
        if not is_dynamic_matmul(func):
            continue
        key = workload_key(func)
        if key in tasks:  # the same operator under another name: its calls add up (fused: where all are)
            tasks[key] = dataclasses.replace(tasks[key], calls=tasks[key].calls + calls.get(gvar.name_hint, 0),
                                             softmax=tasks[key].softmax and gvar.name_hint in softmaxed)
            continue
        batch, seq_len = SHAPE_VARS
        rows = names_in(matmul_axes(func)["i"])
        if PACKED_VARS[0] in rows:  # a packed model's: its rows are the tokens of every sequence run
            vary, fixed, task_weights = {"var": PACKED_VARS[0], "values": values}, {}, token_weights
        elif seq_len in rows:
            vary, fixed, task_weights = {"var": seq_len, "values": values}, {batch: 1}, weights
        else:
            vary = {"var": batch, "values": list(range(1, request.max_batch + 1))}
            fixed, task_weights = {seq_len: min(POOLING_TUNE_LENGTH, max_len)}, []
        tasks[key] = TaskDescription(
            workload=key, operator=gvar.name_hint, calls=calls.get(gvar.name_hint, 0),
            func=tvm.ir.save_json(func), vary=vary, fixed=fixed, weights=task_weights,
            softmax=gvar.name_hint in softmaxed)
    model = {"name": display_name(request.model, folder), "config": checkpoint.config.to_dict()}
    attention = None
    if request.layout == LAYOUT_PACKED and target.kind.name == "llvm":
        attention = attention_task(checkpoint.config, max_len, weights)
    return TaskFile(model=model, target=target_description(target), tasks=list(tasks.values()), attention=attention,
                    precision=request.precision)


def _weights(observations: Sequence[int], values: list[int]) -> list[float]:
    """How often each of ``values`` was observed (one past the last counts as the last: the last
    interval's kernel runs it); empty where nothing was: every value alike."""
    observed = Counter(min(value, values[-1]) for value in observations)
    return [float(observed.get(v, 0)) for v in values] if observed else []


def tuner_command(task_file: Path, request: TuneRequest, plans: Path) -> list[str]:
    """The tuner's own command line for this request (it runs as a child process)."""
    command = [sys.executable, "-m", "tuner", "tune-tasks", "--tasks", str(task_file), "--db", str(request.db),
               "--plans", str(plans), "--trials", str(request.trials)]
    if request.time_budget_s is not None:
        command += ["--time-budget", str(request.time_budget_s)]
    if request.rpc_tracker:
        command += ["--rpc-tracker", request.rpc_tracker, "--rpc-key", request.rpc_key]
    elif request.cpu_turns is not None:
        command += ["--cpu-turns", str(request.cpu_turns)]
    return command


def run_tuner(task_file: Path, request: TuneRequest, plans: Path) -> None:
    """``python -m tuner tune-tasks`` in a child process; its progress goes to our stderr."""
    command = tuner_command(task_file, request, plans)
    try:
        completed = subprocess.run(command, check=False)
    except OSError as err:
        raise TuningError(f"cannot start the tuner ({' '.join(command[:3])}): {err}") from err
    if completed.returncode != 0:
        raise TuningError(f"the tuner exited with status {completed.returncode}; is it installed "
                          f"(pip install -e '.[tune]')? See its messages above.")


def tune_model(request: TuneRequest, cache_dir: Path, progress: Progress = lambda _m: None) -> Path:
    """Extract tasks, tune them (reusing the records database), link the plans into an artifact
    under ``out/artifact``; returns the artifact directory."""
    out = Path(request.out)
    out.mkdir(parents=True, exist_ok=True)
    progress("extracting the model's dynamic operators")
    tasks = tuning_tasks(request.compile, cache_dir, request.lengths, request.tokens)
    task_file = tasks.write(out / TASKS_FILE)
    total_calls = sum(task.calls for task in tasks.tasks)
    progress(f"{len(tasks.tasks)} distinct operators ({total_calls} call sites) -> {task_file}")
    plans = out / PLANS_DIR
    run_tuner(task_file, request, plans)
    # Link this model's plans only: a plan left in the folder by an earlier version of the model
    # (or of the kernels' code) names a workload the model no longer has, and would be refused.
    current = [plan_path(plans, task.workload) for task in tasks.tasks]
    stale = sorted(set(plans.glob(f"*{PLAN_SUFFIX}")) - set(current))
    if tasks.attention is not None:
        attention = attention_plan_path(plans, tasks.attention.heads, tasks.attention.head_dim)
        if attention.exists():
            current.append(attention)
        else:
            progress(f"no attention plan came back ({attention.name}): attention keeps the hardware's tile")
    if stale:
        progress(f"not linking {len(stale)} plan(s) in {plans} for operators this model no longer has: "
                 f"{', '.join(path.name for path in stale)}")
    linked = dataclasses.replace(request.compile, plans=tuple(current))
    return compile_artifact(linked, cache_dir, out / ARTIFACT_DIR, progress=progress)


def predicted_gain(served: list[KernelPlan], tuned: list[KernelPlan], traffic: Traffic,
                   calls: Mapping[str, int]) -> float | None:
    """Weighted kernel time of the served plans / of the newly tuned ones over the recorded
    traffic (each operator counted once per call site): above 1, the new kernels should be faster.
    Compares only the workloads both have, timed alike (both with the fused softmax or both
    without); None when there is nothing to compare."""
    old = {plan.workload: plan for plan in served}
    totals = [0.0, 0.0]
    for plan in tuned:
        if plan.workload not in old or _timed_with_softmax(old[plan.workload]) != _timed_with_softmax(plan):
            continue
        for (rows, seq_len), weight in traffic.execution_shapes():
            shape = dispatch_shape(rows, seq_len)
            before, after = predicted_latency(old[plan.workload], shape), predicted_latency(plan, shape)
            if before is None or after is None:
                continue
            totals[0] += weight * calls.get(plan.operator, 1) * before
            totals[1] += weight * calls.get(plan.operator, 1) * after
    return totals[0] / totals[1] if totals[1] > 0 else None


def _timed_with_softmax(plan: KernelPlan) -> bool:
    return bool(plan.provenance.get("softmax", False))
