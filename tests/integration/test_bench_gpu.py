"""What of the GPU benchmark (tests/benchmarks/bench_gpu.py) runs without a GPU: bert-base's
weights drawn on the GPU host from the carried layout rebuild the artifact's parameters hash for
hash; the end-to-end measurement, run on a CPU artifact beside transformers on the CPU, agrees
with it; the dense table compares each precision's kernels with cuBLAS in that precision. The
GPU itself is exercised only on a lent device (tests/gpu/remote_check.py run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dietserve.model.config import BERT_BASE
from dietserve.model.presets import random_weight_layout, resolve_model
from dietserve.model.seeded_weights import seeded_tensors
from tests.benchmarks.agreement import token_agreement
from tests.benchmarks.bench_gpu import dense_ratios, measure_shapes, report
from tests.gpu.carried_artifacts import carry_artifact, restore_params


def test_bert_base_weights_drawn_from_the_carried_layout_rebuild_the_artifacts_params(
        bert_base_artifact: Path, cache_dir: Path, tmp_path: Path) -> None:
    checkpoint = resolve_model("bert-base", cache_dir)  # the preset's seed, 0
    carry_artifact(bert_base_artifact, checkpoint, tmp_path / "carried")
    assert not (tmp_path / "carried" / "params.safetensors").exists()
    layout = json.loads(json.dumps(random_weight_layout(BERT_BASE)))  # as bench.json carries it
    assert restore_params(tmp_path / "carried", tmp_path / "restored", seeded_tensors(layout, 0))
    assert not restore_params(tmp_path / "carried", tmp_path / "other-seed", seeded_tensors(layout, 1))


def test_end_to_end_rows_time_a_cpu_artifact_and_agree_with_transformers(minilm_engine, minilm_reference) -> None:
    rows = measure_shapes("minilm", {"fp32": minilm_engine}, {"eager_fp32": minilm_reference}, [(1, 5), (2, 17)],
                          sync=lambda: None, torch_device="cpu", repeats=2)
    assert [(row["batch"], row["seq"]) for row in rows] == [(1, 5), (2, 17)]
    for row in rows:
        assert row["ours_fp32_min_cosine"] > 0.99999 and row["ours_fp32_max_abs"] < 1e-3
        assert row["ours_fp32_ms"] > 0 and row["torch_eager_fp32_ms"] > 0 and row["ours_fp32_first_over_median"] > 0
    metrics = report({"rows": rows}, [])
    assert metrics["minilm_fp32_vs_eager_b1"] == pytest.approx(rows[0]["torch_eager_fp32_ms"] / rows[0]["ours_fp32_ms"])
    assert metrics["min_fp32_token_cosine"] == min(row["ours_fp32_min_cosine"] for row in rows)


def test_token_agreement_sees_one_wrong_token() -> None:
    reference = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    ours = reference.copy()
    assert token_agreement(ours, reference) == pytest.approx((1.0, 0.0))
    ours[1, 2] = -ours[1, 2]
    cosine, error = token_agreement(ours, reference)
    assert cosine == pytest.approx(-1.0) and error == pytest.approx(2 * np.abs(reference[1, 2]).max())


def _kernel(id_, precision, us, ok=True):
    return {"id": id_, "op": "ffn_up", "kernel_name": id_, "precision": precision, "check_ok": ok,
            "timings": {"64": {"us": us}}}


def test_dense_table_compares_each_precision_with_cublas_in_that_precision() -> None:
    lines = [_kernel("cuda_core", "fp32", 10.0), _kernel("tensor_core", "fp16", 4.0),
             _kernel("wrong", "fp16", 1.0, ok=False),
             {"id": "torch-ffn_up-fp32", "op": "ffn_up", "precision": "fp32", "timings": {"64": {"us": 12.0}}},
             {"id": "torch-ffn_up-fp16", "op": "ffn_up", "precision": "fp16", "timings": {"64": {"us": 5.0}}}]
    ratios = {d["precision"]: (d["kernel"], d["ratio"]) for d in dense_ratios(lines)}
    # fp32: CUDA-core kernels only; fp16: any correct one (the wrong, fastest one is never picked)
    assert ratios == {"fp32": ("cuda_core", 1.2), "fp16": ("tensor_core", 1.25)}
    metrics = report({"rows": []}, lines)
    assert metrics["dense_fp16_vs_cublas"] == pytest.approx(1.25) and math.isnan(metrics["min_fp16_token_cosine"])
