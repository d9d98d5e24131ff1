"""The cold start's plans (``--plans analytic``): every dynamic operator planned from the hardware
model, measuring nothing; the plans are valid, linked into the model, and the model matches
transformers across the plans' splits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.compile.cold_start import analytic_plans
from dietserve.compile.tuning import tuning_tasks
from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.cpu_packed.kernel import packed_tile
from dietserve.kernels.cpu_packed.tile import register_footprint
from dietserve.kernels.plan.decision_tree import thresholds
from dietserve.kernels.plan.kernel_plan import KernelPlan
from dietserve.kernels.space.analytic import ANALYTIC_SOURCE, analytic_plan
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
from dietserve.runtime.manifest import PLANS_ANALYTIC, Manifest

from .conftest import MAX_BATCH
from .reference import padded_batch, reference_hidden

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def cold_artifact(cache_dir):
    return compile_artifact(CompileRequest(model="default", max_batch=MAX_BATCH, analytic=True), cache_dir)


def test_every_dynamic_operator_is_planned_from_the_hardware_model(cold_artifact, cache_dir) -> None:
    manifest = Manifest.read(cold_artifact)
    assert manifest.kernel_plans == PLANS_ANALYTIC
    tasks = tuning_tasks(CompileRequest(model="default", max_batch=MAX_BATCH), cache_dir)
    planned = {entry["workload"] for entry in manifest.dispatch.values() if entry["plan"]}
    assert planned == {task.workload for task in tasks.tasks}
    plans = analytic_plans(CompileRequest(model="default", max_batch=MAX_BATCH), cache_dir)
    for plan in plans:
        again = KernelPlan.from_dict(json.loads(plan.to_json()))
        assert again.digest() == plan.digest() and plan.provenance["source"] == ANALYTIC_SOURCE
        assert all(row["variant"] in plan.variants for row in plan.shapes)


def _split_shapes(artifact) -> list[tuple[int, int]]:
    """(batch, seq) on both sides of every split of the dense layers' and attention's trees."""
    points = {(1, 1), (3, 13), (8, 64), (1, 512)}
    for entry in Manifest.read(artifact).dispatch.values():
        for var, le in thresholds(entry["tree"]):
            for rows in (le, le + 1):
                if var == "seq_len" and rows <= 512:
                    points.add((1, rows))
                elif var == "batch * seq_len" and rows <= 512:
                    points.add((1, rows))
    return sorted(points)


def test_the_cold_model_matches_transformers_on_both_sides_of_each_split(cold_artifact, minilm_reference) -> None:
    engine = Engine(load_artifact(cold_artifact))
    for batch, seq in _split_shapes(cold_artifact):
        ids, mask, types = padded_batch(np.random.default_rng(batch * 1000 + seq), batch, seq, engine.vocab_size)
        hidden = engine.run(ids, mask, types).last_hidden_state
        error = float(np.abs(hidden - reference_hidden(minilm_reference, ids, mask, types)).max())
        assert error <= TOLERANCE, f"batch={batch} seq={seq}: max abs error {error:.2e}"


@pytest.mark.parametrize("preset", ["avx2", "avx512"])
def test_plans_fit_the_registers_of_the_hardware_they_are_made_for(cache_dir, preset) -> None:
    """Planned for another ISA (nothing is built or run), the tiles follow its register file:
    AVX-512's 32 registers of 16 lanes hold taller and wider tiles than AVX2's 16 of 8."""
    hardware = CPU_PRESETS[preset]
    tasks = tuning_tasks(CompileRequest(model="default", max_batch=MAX_BATCH), cache_dir)
    tallest = 0
    for task in tasks.tasks:
        plan = analytic_plan(tvm.ir.load_json(task.func), task.operator, task.vary, task.fixed, task.weights,
                             {"kind": "llvm", "mcpu": preset}, str(tvm.__version__), hardware)
        assert plan is not None
        for name in plan.variants:
            kernel = plan.kernel(name)
            assert kernel.vector == hardware.lanes()
            if kernel.pack:
                mr, panel, pk, _ = packed_tile(kernel)
                assert register_footprint(mr, pk * panel // hardware.lanes()) <= hardware.vector_registers
                tallest = max(tallest, mr)
    assert tallest > (6 if preset == "avx512" else 2)
