"""Tuning the packed attention kernel: the plan format (``kernels/plan/attention_plan.py``), the
length groups that weight it, and a real tune in a measurement process whose plan builds a kernel
that matches numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm

from dietserve.host.cpu import configure_cpu_threads, cpu_flags, host_cpu
from dietserve.host.hardware import detect_cpu
from dietserve.kernels.cpu_varlen.attention import varlen_attention
from dietserve.kernels.cpu_varlen.tile import VarlenTile, attention_tiles
from dietserve.kernels.plan.attention_plan import AttentionPlan, attention_plan_path, read_attention_plans
from dietserve.kernels.plan.decision_tree import choose
from dietserve.kernels.plan.kernel_plan import PlanError
from dietserve.kernels.plan.task_file import AttentionKernel, AttentionTask, TaskFile, TaskFileError
from dietserve.kernels.tir.build import build
from dietserve.model.config import BertConfig
from dietserve.model.modernbert import window_bias
from tuner.attention import length_groups, task_digest, tune_attention
from tuner.measure.attention import numpy_attention
from tuner.measure.timing import TimingPolicy

from .test_varlen_attention import MAX_LEN, reference

TARGET = {"kind": "llvm", "mcpu": "x86-64-v3", "num-cores": 2}
TILES = {"a": VarlenTile().to_dict(), "b": VarlenTile(mr=2).to_dict()}
TREE = {"var": "length", "le": 16, "then": {"variant": "a"}, "else": {"variant": "b"}}


def plan(**changes) -> AttentionPlan:
    return AttentionPlan(**{"heads": 2, "head_dim": 16, "target": TARGET, "tvm_version": "0.27", "tiles": TILES,
                            "tree": TREE, **changes})


def test_a_plan_round_trips_and_is_found_among_kernel_plans(tmp_path) -> None:
    written = plan().write(attention_plan_path(tmp_path, 2, 16))
    (tmp_path / "other.plan.json").write_text("{}")  # a kernel plan beside it is not read here
    assert AttentionPlan.read(written) == plan()
    assert read_attention_plans([tmp_path]) == [plan()] and read_attention_plans([written]) == [plan()]
    assert read_attention_plans([tmp_path / "other.plan.json"]) == []
    assert written.name == "varlen_attention[H=2,d=16].attention.json"


@pytest.mark.parametrize("changes, message", [
    ({"tiles": {"a": {"mr": 4, "nr": 12, "nc": 16, "lanes": 8}, "b": TILES["b"]}}, "tile 'a' is not a register tile"),
    ({"tree": {"variant": "c"}}, "unknown variant 'c'"),
    ({"tree": {**TREE, "var": "tokens"}}, "names 'tokens', not one of"),
    ({"tree": {**TREE, "var": "length + 1"}}, r"branches on 'length \+ 1', not 'length'"),
    ({"tree": {"variant": "a"}}, r"tiles \['b'\] are reached by no leaf"),
    ({"heads": 0}, "positive integers"),
    ({"format": "dietserve.kernel-plan"}, "not an attention plan"),
])
def test_a_malformed_plan_is_refused_naming_what_is_wrong(changes: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan(**changes)


def test_a_plan_for_another_cpu_or_tvm_is_stale(tmp_path) -> None:
    with pytest.raises(PlanError, match="tuned with TVM 0.27; this is TVM 0.28"):
        plan().check_target(TARGET, "0.28")
    with pytest.raises(PlanError, match="tuned for mcpu='x86-64-v3'; compiling for mcpu='znver4'"):
        plan().check_target({**TARGET, "mcpu": "znver4"}, "0.27")
    path = tmp_path / "x.attention.json"
    path.write_text(json.dumps({**json.loads(plan().to_json()), "extra": 1}))
    with pytest.raises(PlanError, match=r"unknown fields \['extra'\]"):
        AttentionPlan.read(path)


def test_length_groups_split_the_weight_evenly() -> None:
    uniform = length_groups(AttentionTask(2, 16, 512))
    assert [last for last, _, _ in uniform] == list(range(64, 513, 64))
    assert all(last - 63 <= timed <= last for last, timed, _ in uniform)
    weights = [0.0] * 128
    for length, count in ((5, 1), (20, 1), (40, 5), (120, 1)):
        weights[length - 1] = count
    observed = length_groups(AttentionTask(2, 16, 128, weights))
    assert [(last, timed) for last, timed, _ in observed] == [(5, 5), (20, 20), (40, 40), (128, 120)]
    assert [share for _, _, share in observed] == pytest.approx([1 / 8, 1 / 8, 5 / 8, 1 / 8])
    with pytest.raises(TaskFileError, match="one per length"):
        AttentionTask(2, 16, 128, [1.0] * 3)


def test_a_tune_times_every_tile_and_its_plan_builds_a_correct_kernel() -> None:
    """A real tune (measurement process, this CPU, a quick timing): every tile of the space timed
    at each group's length, the plan no slower over the weighted lengths than the hardware's own
    tile by its own readings, and the kernel it describes right on lengths across its splits."""
    hardware = detect_cpu(cpu_flags() or set()).with_overrides(cores=2)
    weights = [1.0 if length in (3, 9, 30, 64) else 0.0 for length in range(1, 65)]
    task = AttentionTask(heads=2, head_dim=16, max_len=64, weights=weights)
    target = {"kind": "llvm", "mcpu": host_cpu(), "num-cores": 2}  # (the ISA the detected tiles are for)
    said: list[str] = []
    tuned = tune_attention(task, target, hardware, 2, TimingPolicy(number=1, repeat=1, min_repeat_ms=1),
                           str(tvm.__version__), 7, timeout_s=600, say=said.append)
    assert tuned.provenance["tiles_timed"] == len(attention_tiles(hardware, 16))
    assert tuned.provenance["tiles_failed"] == 0
    assert [entry["length"] for entry in tuned.lengths] == [3, 9, 30, 64]
    chosen = sum(e["weight"] * e["latency_s"] for e in tuned.lengths)
    assert chosen <= sum(e["weight"] * e["default_latency_s"] for e in tuned.lengths) * (1 + 1e-9)
    assert all(choose(tuned.tree, {"length": e["length"]}) == e["tile"] for e in tuned.lengths)
    assert any("chosen" in line for line in said)
    configure_cpu_threads(2)
    func = varlen_attention(2, 16, 64, tuned.varlen_tiles(), tuned.tree).with_attr("global_symbol", "main")
    kernel = build(tvm.IRModule({"main": func}), tvm.target.Target(target))["main"]
    lengths = [1, 3, 4, 9, 10, 30, 31, 64, 2]
    qkv = np.random.default_rng(3).standard_normal((sum(lengths), 96)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = tvm.runtime.tensor(np.full((sum(lengths), 32), np.nan, np.float32))
    kernel(tvm.runtime.tensor(qkv), tvm.runtime.tensor(starts), out)
    expected = reference(qkv, starts, 2, 16)
    assert np.abs(out.numpy() - expected).max() / np.abs(expected).max() < 1e-5


def test_the_command_line_tune_without_weights_records_every_length_alike(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "tuner", "tune", "--op", "varlen_attention", "--heads", "2",
                           "--head-dim", "16", "--t", "1:24", "--db", str(tmp_path / "records.jsonl")],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (written,) = read_attention_plans([attention_plan_path(tmp_path, 2, 16)])
    assert written.provenance["weights"] == "uniform"
    assert {entry["up_to"] for entry in written.lengths} >= {24} and written.heads == 2


# Each family's attention as served: (heads, kv_heads, its kernels' (calls, relative_bias, window, causal))
SERVED = {
    "bert": (lambda: __import__("transformers").BertConfig(num_hidden_layers=4), (12, 12, [(4, False, None, False)])),
    "mpnet": (lambda: __import__("transformers").MPNetConfig(num_hidden_layers=4), (12, 12, [(4, True, None, False)])),
    # every third layer global (transformers' global_attn_every_n_layers), the others local over 128 keys
    "modernbert": (lambda: __import__("transformers").ModernBertConfig(num_hidden_layers=7),
                   (12, 12, [(3, False, None, False), (4, True, 64, False)])),
    "qwen3": (lambda: __import__("transformers").Qwen3Config(num_hidden_layers=5, num_attention_heads=8,
                                                              num_key_value_heads=2, head_dim=32),
              (8, 2, [(5, True, None, True)])),
    # EmbeddingGemma's: a full layer in six, the others within a window (transformers: sliding_window // 2 away)
    "gemma3": (lambda: __import__("transformers").Gemma3TextConfig(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
        use_bidirectional_attention=True), (4, 1, [(1, False, None, False), (5, True, 256, False)])),
    # e5-mistral's: every layer causal within transformers' window of 4,096 (the query and 4,095 keys before it)
    "mistral": (lambda: __import__("transformers").MistralConfig(num_hidden_layers=3, sliding_window=4096),
                (32, 8, [(3, True, 4095, True)])),
    "mistral-unwindowed": (lambda: __import__("transformers").MistralConfig(num_hidden_layers=3, sliding_window=None),
                           (32, 8, [(3, True, None, True)])),
    "qwen2": (lambda: __import__("transformers").Qwen2Config(num_hidden_layers=2, num_key_value_heads=4),
              (32, 4, [(2, True, None, True)])),
    # gte-Qwen2-7B-instruct's: bidirectional
    "qwen2-bidirectional": (lambda: __import__("transformers").Qwen2Config(num_hidden_layers=2, is_causal=False),
                            (32, 32, [(2, False, None, False)])),
    "llama": (lambda: __import__("transformers").LlamaConfig(num_hidden_layers=2), (32, 32, [(2, True, None, True)])),
    "nomic_bert": (lambda: __import__("transformers").NomicBertConfig(num_hidden_layers=3),
                   (12, 12, [(3, False, None, False)])),
    "gte": (lambda: __import__("transformers").GteConfig(num_hidden_layers=2), (12, 12, [(2, False, None, False)])),
}


@pytest.mark.parametrize("family", sorted(SERVED))
def test_the_tuning_task_names_each_familys_attention_kernels_as_served(family: str) -> None:
    """The tuning task's kernels (``compile/packed_attention.py``, which the build also reads) are
    the masking and head sharing transformers' config describes, weighted by the layers running each."""
    from dietserve.compile.packed_attention import attention_task

    theirs, (heads, kv_heads, kernels) = SERVED[family]
    task = attention_task(BertConfig.from_dict(json.loads(theirs().to_json_string())), 64, [])
    assert (task.heads, task.kv_heads) == (heads, kv_heads)
    assert [(k.calls, k.relative_bias, k.window, k.causal) for k in task.kernels] == kernels


def test_an_attention_task_round_trips_and_a_malformed_kernel_is_refused(tmp_path) -> None:
    task = AttentionTask(4, 16, 64, [], 2, (AttentionKernel(3, True, 8), AttentionKernel(1, True, causal=True)))
    written = TaskFile({"name": "m"}, {"kind": "llvm"}, [], task).write(tmp_path / "tasks.json")
    assert TaskFile.read(written).attention == task
    assert AttentionTask(4, 16, 64).kernels == (AttentionKernel(1),)  # an older file's: one plain kernel
    with pytest.raises(TaskFileError, match="needs relative_bias"):
        AttentionTask(4, 16, 64, kernels=({"calls": 1, "causal": True},))
    with pytest.raises(TaskFileError, match="kv_heads must divide the 4 heads"):
        AttentionTask(4, 16, 64, kv_heads=3)
    with pytest.raises(TaskFileError, match="a kernel is malformed"):
        AttentionTask(4, 16, 64, kernels=({"calls": 1, "heads": 2},))
    assert task_digest(task) != task_digest(AttentionTask(4, 16, 64, [], 2, (AttentionKernel(4, True, 8),)))


@pytest.mark.parametrize("kv_heads, reach", [(None, None), (2, "causal"), (1, 8)])
def test_the_measurements_reference_is_the_kernel_tests(kv_heads, reach) -> None:
    """The measurement process checks each tile against its own numpy (it cannot import tests):
    the same numbers as the kernel tests' reference, for shared heads and a window or causal mask."""
    lengths = [1, 13, 40]
    qkv = np.random.default_rng(2).standard_normal((sum(lengths), (4 + 2 * (kv_heads or 4)) * 16))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    bias = None if reach is None else window_bias(4, MAX_LEN, None if reach == "causal" else reach, reach == "causal")
    np.testing.assert_allclose(numpy_attention(qkv, starts, 4, 16, kv_heads, bias),
                               reference(qkv, starts, 4, 16, bias, kv_heads), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kv_heads, kernels", [
    (2, (AttentionKernel(2, True, causal=True),)),  # Qwen3's
    (None, (AttentionKernel(1), AttentionKernel(2, True, 8))),  # ModernBERT's global and local layers
], ids=["causal-shared-heads", "full-and-windowed"])
def test_a_tune_times_the_kernels_as_served_and_its_plan_builds_them_right(kv_heads, kernels) -> None:
    """Every tile is built and checked in each of the task's kernels (a tile timed in a kernel
    other than the one served would fail its check), and the plan's tiles build those kernels right."""
    hardware = detect_cpu(cpu_flags() or set()).with_overrides(cores=2)
    task = AttentionTask(heads=4, head_dim=16, max_len=MAX_LEN, kv_heads=kv_heads, kernels=kernels,
                         weights=[1.0 if length in (5, 40) else 0.0 for length in range(1, MAX_LEN + 1)])
    target = {"kind": "llvm", "mcpu": host_cpu(), "num-cores": 2}
    tuned = tune_attention(task, target, hardware, 2, TimingPolicy(number=1, repeat=1, min_repeat_ms=1),
                           str(tvm.__version__), 7, timeout_s=600)
    assert tuned.provenance["tiles_failed"] == 0
    assert tuned.provenance["tiles_timed"] == len(attention_tiles(hardware, 16))
    configure_cpu_threads(2)
    lengths = [5, 1, 40, 17]
    qkv = np.random.default_rng(4).standard_normal((sum(lengths), (4 + 2 * (kv_heads or 4)) * 16)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for kernel in kernels:
        bias = window_bias(4, MAX_LEN, kernel.window, kernel.causal) if kernel.relative_bias else None
        func = varlen_attention(4, 16, MAX_LEN, tuned.varlen_tiles(), tuned.tree, kv_heads=kv_heads,
                                **kernel.masking()).with_attr("global_symbol", "main")
        function = build(tvm.IRModule({"main": func}), tvm.target.Target(target))["main"]
        out = tvm.runtime.tensor(np.full((sum(lengths), 64), np.nan, np.float32))
        function(tvm.runtime.tensor(qkv), tvm.runtime.tensor(starts),
                 *([] if bias is None else [tvm.runtime.tensor(bias)]), out)
        expected = reference(qkv, starts, 4, 16, bias, kv_heads)
        assert np.abs(out.numpy() - expected).max() / np.abs(expected).max() < 1e-5
