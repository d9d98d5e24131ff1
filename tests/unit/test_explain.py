"""dietserve.explain on a hand-made artifact: a manifest and one plan file, no TVM build."""

from __future__ import annotations

from pathlib import Path

import pytest

from dietserve.explain import explain_attention, explain_rows, format_explain, write_explain_plot
from dietserve.kernels.plan.decision_tree import choose, interval_tree
from dietserve.kernels.plan.kernel_plan import KernelPlan
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.runtime.manifest import Manifest

QUANTITY = "batch * seq_len"
SMALL = MicroKernel(tile=(("i", (4, 2)), ("j", (16, 1)), ("k", (1,))), vector=8)  # 8 rows x 16 columns
LARGE = MicroKernel(tile=(("i", (8, 4)), ("j", (32, 2)), ("k", (4,))), vector=8)  # 32 rows x 64 columns
# (seq_len at batch 1, variant, latency_s, measured): 128 is the tuner's prediction, not timed.
TUNED = [(1, "default", 2.0e-6, True), (8, "v1", 1.0e-5, True), (16, "v1", 2.0e-5, True),
         (32, "v1", 4.0e-5, True), (64, "v1", 8.0e-5, True), (128, "v2", 1.2e-4, False),
         (256, "v2", 2.4e-4, True)]


def _plan() -> KernelPlan:
    rows = [{"shape": {"batch": 1, "seq_len": seq}, "value": seq, "variant": variant, "latency_s": latency,
             "measured": measured, "default_latency_s": 2.0e-6 * seq, "default_measured": seq != 64}
            for seq, variant, latency, measured in TUNED]
    return KernelPlan(
        workload="fused_matmul_test",
        operator="dense_qkv",
        shape_vars=["batch", "seq_len"],
        axes={"b": "1", "i": QUANTITY, "j": "384", "k": "384"},
        target={"kind": "llvm", "mcpu": "test-cpu", "num-cores": 2},
        tvm_version="test",
        variants={"default": None, "v1": SMALL.to_dict(), "v2": LARGE.to_dict()},
        tree=interval_tree(QUANTITY, [seq for seq, *_ in TUNED], [variant for _, variant, *_ in TUNED]),
        tuned_range={"var": QUANTITY, "min": 1, "max": 256},
        shapes=rows,
    )


def _artifact(root: Path, with_plans: bool = True) -> Path:
    directory = root / "art"
    plan = _plan()
    if with_plans:
        plan.write(directory / "plans" / f"{plan.workload}.plan.json")
    directory.mkdir(parents=True, exist_ok=True)
    dispatch = {
        "fused_matmul": {"workload": plan.workload, "plan": plan.digest(), "calls": 6,
                         "shape_vars": ["batch", "seq_len"], "variants": sorted(plan.variants), "tree": plan.tree,
                         "operator": plan.operator},
        "fused_matmul_untuned": {"workload": "other_workload", "plan": None, "calls": 12,
                                 "shape_vars": ["batch", "seq_len"], "variants": ["default"],
                                 "tree": {"variant": "default"}},
    }
    manifest = Manifest(model_name="test-model", model_config={}, normalize_embeddings=False,
                        target={"kind": "llvm", "mcpu": "test-cpu"}, tvm_version="test", cache_key="test",
                        bounds={"batch": 8, "seq_len": 512}, parameters=[], files={}, dispatch=dispatch)
    (directory / "manifest.json").write_text(manifest.to_json())
    return directory


def _tuned(directory: Path, batch: int, seq_len: int):
    rows = {row.operator: row for row in explain_rows(directory, batch, seq_len)}
    assert set(rows) == {"fused_matmul", "fused_matmul_untuned"}
    return rows["fused_matmul"]


@pytest.mark.parametrize(("batch", "seq_len"), [(1, 1), (1, 8), (1, 37), (1, 64), (1, 65), (4, 37), (8, 512)])
def test_variant_follows_the_tree(tmp_path: Path, batch: int, seq_len: int) -> None:
    directory = _artifact(tmp_path)
    row = _tuned(directory, batch, seq_len)
    assert row.variant == choose(_plan().tree, {"batch": batch, "seq_len": seq_len})
    assert row.value == batch * seq_len
    assert row.quantity == QUANTITY
    assert row.tuned_as == "dense_qkv"
    assert row.calls == 6


def test_padding_waste_against_hand_computation(tmp_path: Path) -> None:
    row = _tuned(_artifact(tmp_path), 1, 37)
    assert row.variant == "v1"
    assert row.kernel == str(SMALL)
    assert row.waste_i_pct == pytest.approx(100 * (1 - 37 / 40))  # 37 rows in tiles of 8
    assert row.waste_j_pct == pytest.approx(0.0)  # 384 columns in tiles of 16
    large = _tuned(_artifact(tmp_path / "b"), 3, 50)  # 150 rows in tiles of 32, 384 columns in tiles of 64
    assert large.variant == "v2"
    assert large.waste_i_pct == pytest.approx(100 * (1 - 150 / 160))
    assert large.waste_j_pct == pytest.approx(0.0)
    default = _tuned(_artifact(tmp_path / "c"), 1, 1)
    assert (default.variant, default.kernel, default.waste_i_pct) == ("default", "default rule", None)


def test_measured_predicted_and_extrapolated(tmp_path: Path) -> None:
    directory = _artifact(tmp_path)
    exact = _tuned(directory, 1, 32)
    assert (exact.source, exact.latency_s) == ("measured", 4.0e-5)
    assert (exact.default_source, exact.default_latency_s) == ("measured", pytest.approx(6.4e-5))
    assert exact.gflops == pytest.approx(2 * 32 * 384 * 384 / 4.0e-5 / 1e9)
    same_rows = _tuned(directory, 4, 8)  # 32 rows again: the same matmul as (1, 32)
    assert (same_rows.source, same_rows.latency_s) == ("measured", 4.0e-5)
    between = _tuned(directory, 1, 37)  # nearest tuned row is 32: its throughput carries over
    assert between.source == "predicted"
    assert between.latency_s == pytest.approx(4.0e-5 * 37 / 32)
    model_only = _tuned(directory, 1, 128)
    assert (model_only.source, model_only.latency_s) == ("predicted", 1.2e-4)
    assert _tuned(directory, 1, 64).default_source == "predicted"
    beyond = _tuned(directory, 2, 300)
    assert beyond.source == "extrapolated"
    assert beyond.latency_s == pytest.approx(2.4e-4 * 600 / 256)


def test_operator_without_plan_is_unknown(tmp_path: Path) -> None:
    rows = {row.operator: row for row in explain_rows(_artifact(tmp_path), 1, 37)}
    untuned = rows["fused_matmul_untuned"]
    assert (untuned.variant, untuned.kernel, untuned.calls) == ("default", "default rule", 12)
    assert untuned.latency_s is untuned.source is untuned.default_latency_s is untuned.gflops is None
    assert untuned.value is untuned.waste_i_pct is untuned.waste_j_pct is None


def test_digest_mismatch_drops_the_plan(tmp_path: Path) -> None:
    directory = _artifact(tmp_path)
    manifest = Manifest.read(directory)
    manifest.dispatch["fused_matmul"]["plan"] = "0" * 64
    (directory / "manifest.json").write_text(manifest.to_json())
    row = _tuned(directory, 1, 32)
    assert row.latency_s is None and row.note


def test_shape_outside_bounds(tmp_path: Path) -> None:
    directory = _artifact(tmp_path)
    with pytest.raises(ValueError, match="seq_len=513"):
        explain_rows(directory, 1, 513)
    with pytest.raises(ValueError, match="batch=0"):
        explain_rows(directory, 0, 8)


def test_table(tmp_path: Path) -> None:
    rows = explain_rows(_artifact(tmp_path), 1, 37)
    text = format_explain(rows, 1, 37)
    lines = text.splitlines()
    assert "batch=1" in lines[0] and "seq_len=37" in lines[0]
    assert any(line.startswith("fused_matmul ") and "predicted" in line and "v1" in line for line in lines)
    untuned = next(line for line in lines if line.startswith("fused_matmul_untuned"))
    assert " - " in untuned and "default rule" in untuned
    total = next(line for line in lines if line.startswith("total tuned"))
    assert f"{4.0e-5 * 37 / 32 * 6 * 1e3:.4f} ms" in total and "1 operator(s) without data" in total
    column = lines[1].index("variant")  # fixed width: every row's variant starts under the header
    assert lines[2][column:].startswith("v1 ") and lines[3][column:].startswith("default ")


def test_plot_writes_png(tmp_path: Path) -> None:
    directory = _artifact(tmp_path)
    path = write_explain_plot(directory, tmp_path / "out" / "explain.png", batch=4)
    assert path.is_file() and path.stat().st_size > 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_plans(tmp_path: Path) -> None:
    directory = _artifact(tmp_path, with_plans=False)
    with pytest.raises(ValueError, match="nothing to plot"):
        write_explain_plot(directory, tmp_path / "explain.png")
    rows = {row.operator: row for row in explain_rows(directory, 1, 37)}
    assert rows["fused_matmul"].latency_s is None and "not in plans/" in rows["fused_matmul"].note


def _packed_manifest(directory: Path, flags: list[str], layout: str = "packed") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(model_name="test-model", model_config={"num_attention_heads": 12, "hidden_size": 384},
                        normalize_embeddings=False, target={"kind": "llvm", "mcpu": "test-cpu"}, tvm_version="test",
                        cache_key="test", bounds={"batch": 8, "seq_len": 512}, parameters=[], files={}, dispatch={},
                        required_cpu_flags=flags, layout=layout, precision="bf16")
    (directory / "manifest.json").write_text(manifest.to_json())


@pytest.mark.parametrize(("flags", "tile"), [(["avx2", "fma", "avx512f"], "varlen:6x32,32/16"),
                                             (["avx2", "fma"], "varlen:4x16,16/8")])
def test_attention_without_a_plan_names_the_tile_the_cpu_registers_fit(tmp_path: Path, flags, tile) -> None:
    # AVX-512: 12 accumulators of 6 rows in 32 registers; AVX2: 8 of 4 rows in 16 (cpu_varlen/tile.py)
    _packed_manifest(tmp_path / "art", flags)
    text = explain_attention(tmp_path / "art", 100)
    assert "12 heads of 32" in text and "(bf16 build)" in text
    assert f"length 100 -> {tile}: no attention plan" in text


def test_attention_with_a_plan_names_the_tile_of_the_sequence_length_and_its_timing(tmp_path: Path) -> None:
    from dietserve.kernels.cpu_varlen.tile import LENGTH_VAR, VarlenTile
    from dietserve.kernels.plan.attention_plan import AttentionPlan, attention_plan_path

    short, long = VarlenTile(mr=4, nr=16, nc=32, lanes=16), VarlenTile(mr=6, nr=32, nc=32, lanes=16)
    lengths = [{"length": 30, "up_to": 64, "weight": 0.5, "tile": short.describe(), "latency_s": 1.0e-5,
                "default_latency_s": 1.5e-5},
               {"length": 200, "up_to": 512, "weight": 0.5, "tile": long.describe(), "latency_s": 2.0e-4,
                "default_latency_s": None}]
    plan = AttentionPlan(heads=12, head_dim=32, target={"kind": "llvm", "mcpu": "test-cpu", "num-cores": 2},
                         tvm_version="test", tiles={t.describe(): t.to_dict() for t in (short, long)},
                         tree=interval_tree(LENGTH_VAR, [64, 512], [short.describe(), long.describe()]),
                         lengths=lengths, provenance={"weights": "observed"}, precision="bf16")
    directory = tmp_path / "art"
    _packed_manifest(directory, ["avx2", "fma", "avx512f"])
    plan.write(attention_plan_path(directory / "plans", 12, 32))
    short_text, long_text = explain_attention(directory, 64), explain_attention(directory, 65)
    assert f"length 64 -> {short.describe()}: attention plan, 2 tile(s)" in short_text
    assert "timed at length 30 (lengths up to 64): 0.0100 ms a sequence, the CPU's tile 0.0150 ms" in short_text
    assert f"length 65 -> {long.describe()}" in long_text
    assert "timed at length 200 (lengths up to 512): 0.2000 ms a sequence, the CPU's tile -" in long_text


def test_a_padded_artifact_has_no_attention_kernel_to_explain(tmp_path: Path) -> None:
    _packed_manifest(tmp_path / "art", ["avx2", "fma"], layout="padded")
    assert explain_attention(tmp_path / "art", 100) is None
