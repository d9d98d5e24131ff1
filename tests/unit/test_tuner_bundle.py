"""Tuning through measurement bundles: ``python -m tuner bundle export`` builds a round's CUDA
candidates (nvcc, here), a GPU host measures them (here a fake one, through the device script's
own loop: there is no GPU), ``import`` records the results, and rounds go on until every plan is
written. The exporter's check data is compared with what the device script draws."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest
from dietserve.compile.target import TargetSpec
from dietserve.compile.tuning import tuning_tasks
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan, plan_path
from dietserve.kernels.plan.microkernel import MicroKernel
from tuner.database.records import RecordDatabase
from tuner.measure import bundle_device
from tuner.measure.bundle import BUNDLE_LIMIT, BundleError, import_results, read_bundle
from tuner.ops import from_recipe
from tuner.tune import TUNER_VERSION

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
LENGTHS = [1, 7, 16, 64]
TRIALS, ROUND = 8, 4


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    """MiniLM's CUDA tasks cut to one operator (the FFN's dense + GELU) and four lengths."""
    folder = tmp_path_factory.mktemp("bundle-tasks")
    request = CompileRequest(model="default", target=TargetSpec(kind="cuda", arch="sm_90"), max_batch=1)
    tasks = tuning_tasks(request, folder / "cache")
    chosen = [dataclasses.replace(t, vary={**t.vary, "values": LENGTHS}, weights=[]) for t in tasks.tasks
              if t.vary["var"] == "seq_len" and "gelu" in t.operator]
    assert len(chosen) == 1, [t.operator for t in tasks.tasks]
    return dataclasses.replace(tasks, tasks=chosen).write(folder / "tasks.json")


def _tuner(*args: str) -> str:
    completed = subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stderr


def _fake_gpu(job: dict) -> dict:
    """Latency from the kernel's block tile (bigger tiles faster), the default rule slowest;
    the first micro-kernel of a round fails, as a faulting kernel would."""
    if job["kernel"] is None:
        factor = 4.0
    else:
        if job["id"] == "j0000":
            return {"job": job["id"], "device": "fake", "error": "CUDA error: an illegal memory access"}
        kernel = MicroKernel.from_json(job["kernel"])
        factor = 1.0 + 64.0 / (kernel.tile_of("i") * kernel.tile_of("j"))
    return {"job": job["id"], "device": "fake",
            "latencies_s": [shape["flops"] / 1e12 * factor + 2e-6 for shape in job["shapes"]]}


def test_bundle_rounds_end_in_plans(task_file: Path, tmp_path: Path) -> None:
    db, plans, bundle = tmp_path / "records.jsonl", tmp_path / "plans", tmp_path / "bundle"
    export = ["bundle", "export", "--tasks", str(task_file), "--db", str(db), "--plans", str(plans),
              "--trials", str(TRIALS), "--round-trials", str(ROUND), "--out", str(bundle)]
    rounds = 0
    while "every plan is written" not in _tuner(*export):
        rounds += 1
        assert rounds <= 4, "the tune does not converge"
        index = read_bundle(bundle)
        size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
        assert size < BUNDLE_LIMIT and (bundle / "run.py").read_text() == Path(bundle_device.__file__).read_text()
        assert (bundle / "tvm-runtime.tgz").exists() and list((bundle / "whl").glob("apache_tvm_ffi-*.whl"))
        assert 0 < len(index["jobs"]) <= ROUND
        for job in index["jobs"]:
            assert (bundle / job["library"]).stat().st_size > 0 and (bundle / job["fatbin"]).stat().st_size > 0
        results = tmp_path / f"results-{rounds}"
        results.mkdir()
        half = index["jobs"][: len(index["jobs"]) // 2]
        # A device run cut short: the first half answered, then the rest on a rerun.
        (bundle / "bundle.json").rename(bundle / "full.json")
        (bundle / "bundle.json").write_text(json.dumps({**index, "jobs": half}))
        bundle_device.run_jobs(bundle, results, measure_job=_fake_gpu)
        (bundle / "full.json").replace(bundle / "bundle.json")
        imported, missing = import_results(bundle, results, RecordDatabase(db))
        assert (imported, missing) == (len(half), len(index["jobs"]) - len(half))
        bundle_device.run_jobs(bundle, results, measure_job=_fake_gpu)  # skips the half answered
        assert "imported" in _tuner("bundle", "import", "--bundle", str(bundle), "--results", str(results),
                                    "--db", str(db))
        assert import_results(bundle, results, RecordDatabase(db)) == (0, 0)  # once each
    assert rounds >= 2  # the budget spans rounds
    records = list(RecordDatabase(db).records())
    assert all(r.meta["tuner"] == TUNER_VERSION for r in records)
    assert sum(1 for r in records if not r.ok) >= 1  # the failing kernel is recorded so
    for description in json.loads(task_file.read_text())["tasks"]:
        plan = KernelPlan.read(plan_path(plans, description["workload"]))
        assert plan.provenance["trials_requested"] == TRIALS
        for name, kernel in plan.variants.items():
            assert name == DEFAULT_VARIANT or kernel is not None
    assert "every plan is written" in _tuner(*export)  # finished tunes export nothing


def test_device_check_data_matches_the_exporters(task_file: Path, tmp_path: Path) -> None:
    """The device script redraws the check inputs from the bundle's seed: the same arrays, so
    the expected output shipped is the right one."""
    from tuner.measure.bundle import _write_check

    spec = from_recipe(("dense", 64, 48, "bias_gelu"))
    entry = _write_check(tmp_path, "c.npy", spec, {"T": 13})
    rng = np.random.default_rng(entry["check_seed"])
    drawn = [rng.uniform(-1, 1, s).astype("float32") for s in entry["check_inputs"]]
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), spec.expected({"T": 13}, drawn), rtol=1e-6)
    assert [float(x.sum(dtype=np.float64)) for x in drawn] == entry["check_sums"]
    # A tensor-core kernel's check: the product's operands rounded to fp16, as it reads them.
    entry = _write_check(tmp_path, "m.npy", spec, {"T": 13}, fp16_operands=True)
    rounded = [x.astype(np.float16).astype(np.float32) if i < 2 else x for i, x in enumerate(drawn)]
    np.testing.assert_allclose(np.load(tmp_path / "m.npy"), spec.expected({"T": 13}, rounded), rtol=1e-6)
    assert entry["tolerance"] > 1e-3 and np.abs(np.load(tmp_path / "m.npy") - np.load(tmp_path / "c.npy")).max() > 0


def test_bundle_of_another_tuner_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bundle.json").write_text(json.dumps({"format": "dietserve.measure-bundle", "version": 1,
                                                      "tuner": TUNER_VERSION - 1, "jobs": []}))
    with pytest.raises(BundleError, match="tuner version"):
        read_bundle(tmp_path)
