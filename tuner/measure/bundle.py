"""Tuning through files, for GPU hosts that no network reaches (an RPC tune needs one):

    python -m tuner bundle export --tasks tasks.json --db records.jsonl --plans DIR --trials 64 --out B
    python3 B/run.py --out RESULTS                 (on the GPU host: numpy and a driver, no TVM)
    python -m tuner bundle import --bundle B --results RESULTS --db records.jsonl

and again until ``export`` reports every plan written. ``export`` resumes each task's tune from
its records (``TuneOptions.resume``) to the end of its next round with a ``BundleRunner``, whose
every job is pending; it builds the pending candidates here (nvcc) and writes them, with their
check data and ``bundle_device.py``, into the bundle. ``import`` appends the device's results to
the records once each, as an RPC tune would have recorded them.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dietserve.host.atomic_io import write_text_atomic
from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT
from dietserve.kernels.plan.microkernel import MicroKernel

from ..database.records import RecordDatabase, TuningRecord
from . import bundle_device
from .job import MeasureJob, MeasureResult, RunnerFeatures, WorkerJob

BUNDLE_FORMAT = "dietserve.measure-bundle"
BUNDLE_VERSION = 1
BUNDLE_LIMIT = 62 << 20  # what one visit to a GPU host may carry, with room for the results
CHECK_SEED = 0


class BundleError(ValueError):
    """A bundle or its results cannot be read, or do not belong together."""


class BundleRunner:
    """Measures nothing: each job it is given is pending, kept in ``jobs`` for the bundle."""

    features = RunnerFeatures()

    def __init__(self) -> None:
        self.jobs: list[MeasureJob] = []

    def describe(self) -> str:
        return "bundle"

    def prepare(self, jobs: Sequence[MeasureJob]) -> None:
        """(Built when the bundle is written.)"""

    def run(self, job: MeasureJob) -> MeasureResult:
        self.jobs.append(job)
        return MeasureResult(pending=True)


def _shape_entry(spec, shape: dict) -> dict:
    return {"shape": dict(shape), "inputs": [list(s) for s in spec.input_shapes(shape)],
            "output": list(spec.output_shape(shape)), "flops": spec.flops(shape),
            "scalars": [[position, shape[name]] for position, name in spec.scalar_params]}


def _write_check(folder: Path, name: str, spec, shape: dict, fp16_operands: bool = False) -> dict:
    """The check's expected output, as numpy computes it from inputs the device draws alike
    (the same generator and seed; their sums tell a generator that draws otherwise); for a
    tensor-core kernel from the product's operands rounded to fp16, as it reads them, and with
    its looser bar (``worker.py``)."""
    from ..ops import random_inputs
    from .worker import CHECK_ATOL, MMA_CHECK_TOLERANCE

    inputs = random_inputs(spec, shape, seed=CHECK_SEED)
    operands = [x.astype(np.float16).astype(np.float32) if fp16_operands and i < 2 else x
                for i, x in enumerate(inputs)]
    np.save(folder / name, spec.expected(shape, operands).astype("float32"))
    entry = _shape_entry(spec, shape)
    return {"check": name, "check_seed": CHECK_SEED, "check_inputs": entry["inputs"],
            "check_scalars": entry["scalars"], "check_sums": [float(x.sum(dtype=np.float64)) for x in inputs],
            "tolerance": MMA_CHECK_TOLERANCE if fp16_operands else CHECK_ATOL}


def _build(job: MeasureJob, spec, folder: Path, name: str) -> dict:
    """Compiles ``job``'s candidate into ``name``.so with its fatbin beside it."""
    from tvm.target import Target

    from dietserve.compile.cuda import compile_fatbin, source_digest
    from dietserve.kernels.cuda.source import find_cuda_source

    from .worker import compiled

    executable = compiled(WorkerJob(job), spec)
    source = find_cuda_source(executable.mod)
    if source is None:
        raise RuntimeError("the candidate compiled to no CUDA kernel")
    device_target = Target({key: value for key, value in job.target.items() if key != "host"})
    (folder / f"{name}.fatbin").write_bytes(compile_fatbin(source, device_target))
    executable.export_library(str(folder / f"{name}.so"))
    return {"library": f"{name}.so", "fatbin": f"{name}.fatbin", "source_sha256": source_digest(source)}


def _failed_build(database: RecordDatabase, task, job: MeasureJob, error: str) -> None:
    from ..tune import TUNER_VERSION

    database.append(TuningRecord(
        workload=task.workload, target=task.target_key, kernel=job.kernel or DEFAULT_VARIANT, shape=dict(job.shape),
        latency_s=None, error=error[:2000],
        meta={"tuner": TUNER_VERSION, "runner": "bundle (build)", "time": time.time(),
              "check_shape": dict(job.check_shape)}))


def write_bundle(out: Path, pending: Sequence[tuple[object, Sequence[MeasureJob]]], database: RecordDatabase,
                 say=print) -> int:
    """Builds each task's pending jobs and writes the bundle to ``out`` (replaced); a candidate
    that fails to build is recorded failed at once. Returns the number of jobs in the bundle."""
    from ..tune import TUNER_VERSION

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "jobs").mkdir(parents=True)
    jobs, checks = [], {}
    for task, task_jobs in pending:
        for job in task_jobs:
            name = f"j{len(jobs):04d}"
            try:
                built = _build(job, task.spec, staging / "jobs", name)
            except Exception as err:  # noqa: BLE001 - a candidate that does not build is a result
                _failed_build(database, task, job, f"{type(err).__name__}: {err}")
                continue
            mma = job.kernel is not None and bool(MicroKernel.from_json(job.kernel).mma)
            check_key = (task.workload, tuple(sorted(job.check_shape.items())), mma)
            if check_key not in checks:
                checks[check_key] = _write_check(staging / "jobs", f"c{len(checks):03d}.npy", task.spec,
                                                 dict(job.check_shape), mma)
            jobs.append({"id": name, "workload": task.workload, "target": task.target_key, "kernel": job.kernel,
                         "check_shape": dict(job.check_shape), **checks[check_key],
                         "shapes": [_shape_entry(task.spec, shape) for shape in job.shapes],
                         **{key: f"jobs/{value}" if key in ("library", "fatbin") else value
                            for key, value in built.items()}})
            if len(jobs) % 16 == 0:
                say(f"built {len(jobs)} candidates")
    for entry in jobs:
        entry["check"] = f"jobs/{entry['check']}"
    _finish(staging, out, jobs, TUNER_VERSION)
    return len(jobs)


def _finish(staging: Path, out: Path, jobs: list[dict], tuner_version: int) -> None:
    from dietserve.runtime.tvm_runtime_only import write_runtime_package

    write_runtime_package(staging)
    shutil.copyfile(bundle_device.__file__, staging / "run.py")
    index = {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "bundle": uuid.uuid4().hex,
             "tuner": tuner_version, "created": time.time(), "jobs": jobs}
    write_text_atomic(staging / "bundle.json", json.dumps(index, indent=1))
    size = sum(path.stat().st_size for path in staging.rglob("*") if path.is_file())
    if size > BUNDLE_LIMIT:
        raise BundleError(f"the bundle would be {size / 2**20:.1f} MiB, over {BUNDLE_LIMIT / 2**20:.0f} MiB: "
                          f"export fewer trials a round (--round-trials)")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def read_bundle(folder: Path) -> dict:
    from ..tune import TUNER_VERSION

    try:
        index = json.loads((Path(folder) / "bundle.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BundleError(f"{folder} is not a readable bundle: {err}") from None
    if index.get("format") != BUNDLE_FORMAT or index.get("version") != BUNDLE_VERSION:
        raise BundleError(f"{folder}: not a {BUNDLE_FORMAT} version {BUNDLE_VERSION} bundle")
    if index.get("tuner") != TUNER_VERSION:
        raise BundleError(f"{folder} was exported by tuner version {index.get('tuner')}, this is {TUNER_VERSION}:"
                          " export again")
    return index


def import_results(bundle: Path, results: Path, database: RecordDatabase) -> tuple[int, int]:
    """Appends each result of ``results`` (the device's ``--out`` folder, or its results.jsonl)
    not imported before. Returns (imported, the bundle's jobs still without a result)."""
    index = read_bundle(bundle)
    path = results / bundle_device.RESULTS if results.is_dir() else results
    if not path.exists():
        raise BundleError(f"no results at {path}")
    answers, _ = bundle_device.read_results(path)
    seen = {record.meta.get("job") for record in database.records() if record.meta.get("bundle") == index["bundle"]}
    imported = 0
    for job in index["jobs"]:
        answer = answers.get(job["id"])
        if answer is None or job["id"] in seen:
            continue
        latencies = answer.get("latencies_s")
        shape = job["shapes"][0]
        database.append(TuningRecord(
            workload=job["workload"], target=job["target"], kernel=job["kernel"] or DEFAULT_VARIANT,
            shape=shape["shape"], latency_s=latencies[0] if latencies else None,
            error=None if latencies else answer.get("error", "no result"),
            meta={"tuner": index["tuner"], "runner": f"bundle {answer.get('device', '')}".strip(),
                  "time": time.time(), "flops": shape["flops"], "check_shape": job["check_shape"],
                  "bundle": index["bundle"], "job": job["id"]}))
        imported += 1
    return imported, sum(1 for job in index["jobs"] if job["id"] not in answers)
