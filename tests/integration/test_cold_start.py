"""The cold start's plans (``--plans analytic``): every dynamic operator planned from the hardware
model, measuring nothing; the plans are valid, linked into the model, and the model matches
transformers across the plans' splits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.compile.tuning import tuning_tasks
from dietserve.host.cpu import cpu_flags
from dietserve.host.hardware import CPU_PRESETS, detect_cpu
from dietserve.kernels.cpu_packed.kernel import packed_tile
from dietserve.kernels.cpu_packed.tile import register_footprint
from dietserve.kernels.plan.decision_tree import thresholds
from dietserve.kernels.plan.kernel_plan import KernelPlan, read_plans
from dietserve.kernels.space.analytic import ANALYTIC_SOURCE, analytic_plan
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
from dietserve.runtime.manifest import PLANS_ANALYTIC, PLANS_DIR, Manifest

from .conftest import MAX_BATCH
from .reference import as_layout_answers, padded_batch, reference_hidden

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def cold_artifact(cache_dir):
    return compile_artifact(CompileRequest(model="default", max_batch=MAX_BATCH, analytic=True), cache_dir)


def test_every_dynamic_operator_is_planned_from_the_hardware_model(cold_artifact) -> None:
    manifest = Manifest.read(cold_artifact)
    assert manifest.kernel_plans == PLANS_ANALYTIC
    # The link pass tags every dynamic matmul-like operator; each has a plan linked in.
    assert manifest.dispatch and all(entry["plan"] for entry in manifest.dispatch.values())
    plans = read_plans([cold_artifact / PLANS_DIR])
    assert {plan.workload for plan in plans} == {entry["workload"] for entry in manifest.dispatch.values()}
    for plan in plans:
        assert plan.provenance["source"] == ANALYTIC_SOURCE
        assert KernelPlan.from_dict(json.loads(plan.to_json())).digest() == plan.digest()
        assert all(row["variant"] in plan.variants for row in plan.shapes)


def _split_shapes(artifact) -> list[tuple[int, int]]:
    """(batch, seq) on both sides of every split of the dense layers' and attention's trees."""
    points = {(1, 1), (3, 13), (8, 64), (1, 512)}
    for entry in Manifest.read(artifact).dispatch.values():
        for var, le in thresholds(entry["tree"]):
            # at batch 1 the dense layers' rows (a packed model's tokens) and attention's length are seq_len
            points.update((1, rows) for rows in (le, le + 1)
                          if var in ("seq_len", "batch * seq_len", "tokens") and rows <= 512)
    return sorted(points)


def test_the_cold_model_matches_transformers_on_both_sides_of_each_split(cold_artifact, minilm_reference) -> None:
    engine = Engine(load_artifact(cold_artifact))
    for batch, seq in _split_shapes(cold_artifact):
        ids, mask, types = padded_batch(np.random.default_rng(batch * 1000 + seq), batch, seq, engine.vocab_size)
        hidden = engine.run(ids, mask, types).last_hidden_state
        expected = as_layout_answers(engine, reference_hidden(minilm_reference, ids, mask, types), mask)
        error = float(np.abs(hidden - expected).max())
        assert error <= TOLERANCE, f"batch={batch} seq={seq}: max abs error {error:.2e}"


def test_plans_fit_the_registers_of_the_hardware_they_are_made_for(cold_artifact, cache_dir) -> None:
    """The host's plans (linked above) and plans for AVX-512 (made here, not built or run) keep
    their tiles within the register file: AVX-512's 32 registers of 16 lanes hold taller tiles
    than AVX2's 16 of 8."""
    tasks = tuning_tasks(CompileRequest(model="default", max_batch=MAX_BATCH), cache_dir)
    avx512 = [analytic_plan(tvm.ir.load_json(task.func), task.operator, task.vary, task.fixed, task.weights,
                            {"kind": "llvm", "mcpu": "avx512"}, str(tvm.__version__), CPU_PRESETS["avx512"])
              for task in tasks.tasks]
    host = detect_cpu(cpu_flags() or set())
    for hardware, plans in ((host, read_plans([cold_artifact / PLANS_DIR])), (CPU_PRESETS["avx512"], avx512)):
        tallest = 0
        for plan in plans:
            for name in plan.variants:
                kernel = plan.kernel(name)
                assert kernel.vector == hardware.lanes()
                if kernel.pack:
                    mr, panel, pk, _ = packed_tile(kernel)
                    assert register_footprint(mr, pk * panel // hardware.lanes()) <= hardware.vector_registers
                    tallest = max(tallest, mr)
        assert tallest > (6 if hardware.vector_registers == 32 else 2)
