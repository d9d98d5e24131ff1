"""The kernel plan format (one module reads, writes and checks it) and the tuner's choice of
intervals: malformed plans are refused with a message naming the problem; the interval
segmentation is optimal (checked against brute force) and never uses a forbidden variant."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from dietserve.kernels.plan.decision_tree import segment
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan, PlanError, plan_path, read_plans
from dietserve.kernels.plan.microkernel import MicroKernel

KERNEL = MicroKernel(tile=(("i", (4, 2)), ("j", (16, 1)), ("k", (1,))), vector=8).to_dict()
TREE = {"var": "batch * seq_len", "le": 64, "then": {"variant": "v0"}, "else": {"variant": DEFAULT_VARIANT}}


def plan(**changes) -> KernelPlan:
    fields = dict(workload="00ff00ff00ff00ff", operator="fused_matmul_add", shape_vars=["batch", "seq_len"],
                  axes={"b": "1", "i": "batch * seq_len", "j": "384", "k": "384"},
                  target={"kind": "llvm", "mcpu": "znver3", "num-cores": "2"}, tvm_version="0.27.0",
                  variants={"v0": KERNEL, DEFAULT_VARIANT: None}, tree=TREE,
                  tuned_range={"var": "batch * seq_len", "min": 1, "max": 512})
    fields.update(changes)
    return KernelPlan(**fields)


def test_plan_round_trips_through_its_file(tmp_path: Path) -> None:
    original = plan()
    path = original.write(plan_path(tmp_path / "plans", original.workload))
    assert KernelPlan.read(path) == original and KernelPlan.read(path).digest() == original.digest()
    assert original.kernel("v0") == MicroKernel.from_dict(KERNEL) and original.kernel(DEFAULT_VARIANT) is None
    assert read_plans([tmp_path / "plans"]) == [original]


@pytest.mark.parametrize("change, message", [
    ({"variants": {}}, "lists no variants"),
    ({"variants": {"v0": None, DEFAULT_VARIANT: None}}, "only variant 'default' may be null"),
    ({"variants": {"v0": {"tile": "wide"}, DEFAULT_VARIANT: None}}, "is not a micro-kernel"),
    ({"tree": {"variant": "v9"}}, "unknown variant 'v9'"),
    ({"tree": {**TREE, "var": "tokens"}}, "names 'tokens'"),
    ({"tree": {**TREE, "le": "64"}}, "integer le"),
    ({"tree": {"variant": "v0"}}, r"variants \['default'\] are reached by no leaf"),
    ({"version": 9}, "version 9"),
    ({"format": "something-else"}, "not a kernel plan"),
])
def test_malformed_plans_are_refused_naming_the_problem(change, message) -> None:
    with pytest.raises(PlanError, match=message):
        plan(**change)


def test_unreadable_and_incomplete_files_are_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken.plan.json"
    broken.write_text('{"format": "dietserve.kernel-plan", "version": 1,')
    with pytest.raises(PlanError, match="not valid JSON"):
        KernelPlan.read(broken)
    raw = json.loads(plan().to_json())
    del raw["tree"]
    broken.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="incomplete"):
        KernelPlan.read(broken)
    raw = {**json.loads(plan().to_json()), "surprise": 1}
    broken.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="unknown fields"):
        KernelPlan.read(broken)
    with pytest.raises(PlanError, match="does not exist"):
        read_plans([tmp_path / "missing"])


def test_two_plans_for_one_workload_are_refused(tmp_path: Path) -> None:
    plan().write(tmp_path / "a.plan.json")
    dataclasses.replace(plan(), operator="other").write(tmp_path / "b.plan.json")
    with pytest.raises(PlanError, match="two plans for workload"):
        read_plans([tmp_path])


@pytest.mark.parametrize("target, version, message", [
    ({"kind": "llvm", "mcpu": "skylake"}, "0.27.0", "mcpu='znver3'"),
    ({"kind": "cuda", "arch": "sm_90"}, "0.27.0", "kind='llvm'"),
    ({"kind": "llvm", "mcpu": "znver3"}, "0.28.0", "TVM 0.27.0"),
])
def test_stale_plans_are_refused(target, version, message) -> None:
    with pytest.raises(PlanError, match=message):
        plan().check_target(target, version)
    plan().check_target({"kind": "llvm", "mcpu": "znver3", "num-cores": "16"}, "0.27.0")  # cores may differ


def _brute_force(cost: np.ndarray, max_segments: int) -> float:
    variants, n = cost.shape
    best = np.inf
    for labels in itertools.product(range(variants), repeat=n):
        runs = 1 + sum(a != b for a, b in itertools.pairwise(labels))
        if runs <= max_segments:
            best = min(best, sum(cost[v, s] for s, v in enumerate(labels)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_segmentation_is_optimal_and_bounded(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cost = rng.uniform(1, 10, size=(3, 7))
    cost[1, rng.integers(0, 7)] = np.inf  # variant 1 measured slower than the untuned kernel there
    for max_segments in (1, 2, 3):
        labels = segment(cost, max_segments)
        runs = 1 + sum(a != b for a, b in itertools.pairwise(labels))
        total = sum(cost[v, s] for s, v in enumerate(labels))
        assert runs <= max_segments and np.isfinite(total)
        assert total == pytest.approx(_brute_force(cost, max_segments))


def test_tune_hands_the_tuner_its_budget_and_rpc_tracker() -> None:
    from dietserve.compile.artifact import CompileRequest
    from dietserve.compile.tuning import TuneRequest, tuner_command
    from tuner.cli import build_parser

    request = TuneRequest(compile=CompileRequest(), db=Path("r.jsonl"), out=Path("out"), trials=7, time_budget_s=60,
                          rpc_tracker="tracker:9190", rpc_key="gpu")
    command = tuner_command(Path("tasks.json"), request, Path("plans"))
    assert command[1:3] == ["-m", "tuner"]
    args = build_parser().parse_args(command[3:])  # the tuner's real parser accepts every flag
    assert (args.trials, args.time_budget, args.rpc_tracker, args.rpc_key) == (7, 60.0, "tracker:9190", "gpu")
    assert args.cpu_turns is None  # measured elsewhere: no turns with this machine's server
    local = tuner_command(Path("tasks.json"), TuneRequest(compile=CompileRequest(), db=Path("r.jsonl"), out=Path("o"),
                                                          cpu_turns=Path("/tmp/s.cpu-turns")), Path("plans"))
    assert build_parser().parse_args(local[3:]).cpu_turns == "/tmp/s.cpu-turns"


def test_the_server_s_job_takes_turns_with_its_batches_unless_it_measures_elsewhere() -> None:
    from dietserve.__main__ import build_parser as dietserve_parser
    from dietserve.commands.serve import SHORT_SPIN, retune_settings, short_pool_spin

    for extra, turns in (([], True), (["--retune-rpc-tracker", "t:9190"], False)):
        args = dietserve_parser().parse_args(["serve", *extra])
        settings = retune_settings(args)
        argv = settings.command(Path("/store"), Path("/store/traffic.json"))
        job = dietserve_parser().parse_args(argv[3:])  # the job's own parser accepts every flag
        assert (settings.cpu_turns is not None) == turns and (job.cpu_turns == settings.cpu_turns)
        environ: dict[str, str] = {}
        short_pool_spin(args, True, environ)  # (TVM's pool threads would spin through the job's turn)
        assert environ == ({"TVM_THREAD_POOL_SPIN_COUNT": SHORT_SPIN} if turns else {})
    # the job's fallback build (a version without a build record) is the server's own, precision and layout too
    args = dietserve_parser().parse_args(["serve", "--precision", "bf16", "--layout", "padded", "--seed", "3"])
    job = dietserve_parser().parse_args(retune_settings(args).command(Path("/s"), Path("/s/t.json"))[3:])
    assert (job.precision, job.layout, job.seed) == ("bf16", "padded", 3)
    environ = {"TVM_THREAD_POOL_SPIN_COUNT": "7"}  # the user's own setting stays
    short_pool_spin(dietserve_parser().parse_args(["serve"]), True, environ)
    assert environ == {"TVM_THREAD_POOL_SPIN_COUNT": "7"}


def _timed(latencies: dict[int, float], **changes) -> KernelPlan:
    shapes = [{"value": v, "variant": "v0", "latency_s": t, "measured": True, "default_latency_s": t,
               "shape": {"batch": 1, "seq_len": v}} for v, t in latencies.items()]
    return plan(shapes=shapes, **changes)


def test_predicted_latency_takes_the_nearest_tuned_shape_scaled_by_rows() -> None:
    from dietserve.kernels.plan.kernel_plan import predicted_latency

    timed = _timed({16: 1e-4, 256: 1e-3})
    assert predicted_latency(timed, {"batch": 1, "seq_len": 16}) == pytest.approx(1e-4)
    assert predicted_latency(timed, {"batch": 2, "seq_len": 200}) == pytest.approx(1e-3 * 400 / 256)
    assert predicted_latency(timed, {"batch": 1, "seq_len": 8}) == pytest.approx(1e-4 / 2)
    assert predicted_latency(plan(), {"batch": 1, "seq_len": 8}) is None


def test_predicted_gain_weighs_the_plans_by_the_traffic_and_the_call_sites() -> None:
    from dietserve.compile.tuning import predicted_gain
    from dietserve.runtime.traffic import Traffic

    traffic = Traffic(60.0, 0.0)
    for _ in range(3):
        traffic.record(1, 256, now=0.0)
    served, tuned = _timed({16: 1e-4, 256: 3e-3}), _timed({16: 2e-4, 256: 1e-3})
    other = _timed({256: 1.0}, workload="11ee11ee11ee11ee")  # only in the new plans: not compared
    assert predicted_gain([served], [tuned, other], traffic, {"fused_matmul_add": 6}) == pytest.approx(3.0)
    assert predicted_gain([served], [other], traffic, {}) is None
    # Timed with the fused softmax, the new plan's latencies are not the old one's kind: not compared.
    fused = dataclasses.replace(tuned, provenance={**tuned.provenance, "softmax": True})
    assert predicted_gain([served], [fused], traffic, {"fused_matmul_add": 6}) is None


def test_predicted_gain_prices_a_packed_models_dense_layers_at_each_executions_tokens() -> None:
    """Four texts of 16 tokens run as one packed execution: its dense layers ran 64 rows, not
    16 four times, and the plans are compared there."""
    from dietserve.compile.tuning import predicted_gain
    from dietserve.runtime.traffic import Traffic

    traffic = Traffic(60.0, 0.0)
    traffic.record_packed((16, 16, 16, 16), now=0.0)
    packed = dict(shape_vars=["batch", "seq_len", "tokens", "segments"],
                  axes={"b": "1", "i": "tokens", "j": "384", "k": "384"},
                  tuned_range={"var": "tokens", "min": 1, "max": 512})
    served, tuned = _timed({16: 1e-4, 64: 4e-3}, **packed), _timed({16: 1e-4, 64: 1e-3}, **packed)
    assert predicted_gain([served], [tuned], traffic, {}) == pytest.approx(4.0)
