"""Triton's own load client, perf_analyzer, driving our server unchanged.

No one here wrote it, so it checks that the server speaks KServe v2 / Triton gRPC as Triton's tools
expect (metadata, config, statistics, infer). The binary ships inside the tritonclient 2.50.0
wheel (later ones need glibc 2.38; Debian bookworm has 2.36); it links libcudart.so.12 (PyPI
nvidia-cuda-runtime-cu12) and libb64.so.0d (Debian libb64-0d), which it gets beside it on
LD_LIBRARY_PATH through a ``run.sh`` wrapper. The same recipe as shared/tools/perf_analyzer_setup.sh,
here so that the repository needs nothing outside it and each failing step says which it was.
"""

from __future__ import annotations

import csv
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

TRITONCLIENT = "tritonclient==2.50.0"
CUDA_RUNTIME = "nvidia-cuda-runtime-cu12==12.9.79"
LIBB64 = "libb64-0d"


class PerfAnalyzerError(RuntimeError):
    pass


def _run(step: str, command: list[str], cwd: Path) -> None:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PerfAnalyzerError(f"perf_analyzer setup, {step}: {err}") from err
    if done.returncode != 0:
        raise PerfAnalyzerError(f"perf_analyzer setup, {step} failed ({' '.join(command)}):\n"
                                f"{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.rglob(pattern))
    if not found:
        raise PerfAnalyzerError(f"perf_analyzer setup: no {pattern} under {folder}")
    return found[0]


def _fetch_libb64(folder: Path) -> None:
    # apt-get download needs no root and installs nothing; its package lists may need a refresh.
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise PerfAnalyzerError(f"perf_analyzer needs {LIBB64} (libb64.so.0d); this is not a Debian system")
    try:
        _run(f"apt-get download {LIBB64}", ["apt-get", "download", LIBB64], folder)
    except PerfAnalyzerError:
        _run("apt-get update", ["apt-get", "update"], folder)
        _run(f"apt-get download {LIBB64}", ["apt-get", "download", LIBB64], folder)
    _run("unpacking libb64", ["dpkg-deb", "-x", str(_only(folder, f"{LIBB64}_*.deb")), "b64"], folder)


def ensure_perf_analyzer(cache_dir: Path) -> Path:
    """The ``run.sh`` wrapper of perf_analyzer under ``cache_dir``, set up on the first call."""
    cache_dir = Path(cache_dir).resolve()
    run_sh = cache_dir / "run.sh"
    if run_sh.is_file():
        return run_sh
    cache_dir.mkdir(parents=True, exist_ok=True)
    _run("pip download", [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                          "-d", "dl", TRITONCLIENT, CUDA_RUNTIME], cache_dir)
    for wheel, folder in (("tritonclient-*.whl", "pa"), ("nvidia_cuda_runtime_cu12-*.whl", "cuda")):
        with zipfile.ZipFile(_only(cache_dir / "dl", wheel)) as archive:
            archive.extractall(cache_dir / folder)
    _fetch_libb64(cache_dir)
    binary = _only(cache_dir / "pa", "perf_analyzer")
    binary.chmod(0o755)
    libs = [_only(cache_dir / "b64", "libb64.so.0d").parent, _only(cache_dir / "cuda", "libcudart.so.12").parent]
    staging = run_sh.with_suffix(".tmp")  # run.sh appears only once everything is in place
    library_path = shlex.quote(":".join(map(str, libs)))
    staging.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH={library_path} exec {shlex.quote(str(binary))} "$@"\n')
    staging.chmod(0o755)
    staging.replace(run_sh)
    return run_sh


def write_input_data(path: Path, id_arrays: list[np.ndarray]) -> None:
    """perf_analyzer's ``--input-data`` JSON: one batch-1 request per row of ``id_arrays``, in
    order, each with its own length, an all-ones attention mask and zero token types."""
    entries = []
    for ids in id_arrays:
        for row in np.atleast_2d(np.asarray(ids, dtype=np.int64)):
            shape = [len(row)]
            entries.append({
                "input_ids": {"content": row.tolist(), "shape": shape},
                "attention_mask": {"content": [1] * len(row), "shape": shape},
                "token_type_ids": {"content": [0] * len(row), "shape": shape},
            })
    Path(path).write_text(json.dumps({"data": entries}))


def _summary(stdout: str) -> list[str]:
    """perf_analyzer's own report of the measurement, from "Request concurrency" to the summary."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Request concurrency")), 0)
    end = next((i for i, line in enumerate(lines) if line.startswith("Concurrency:")), len(lines) - 1)
    return [line.rstrip() for line in lines[start : end + 1] if line.strip()]


def run_perf_analyzer(
    run_sh: Path,
    url: str,
    model: str,
    concurrency: int,
    data_file: Path,
    measurement_ms: int = 4000,
    stability_pct: float = 10.0,
    max_trials: int = 10,
) -> tuple[list[str], float, float, float]:
    """(perf_analyzer's summary lines verbatim, requests per second, p50 us, p99 us) of
    ``concurrency`` synchronous clients, measured until three windows of ``measurement_ms``
    agree within ``stability_pct`` on throughput and mean latency. Not p99 (``--percentile``):
    over a few seconds of requests of varied length it rarely settles within 10%."""
    with tempfile.TemporaryDirectory(prefix="perf_analyzer-") as scratch:
        report = Path(scratch) / "report.csv"
        command = [str(run_sh), "-m", model, "-u", url, "-i", "grpc", "--input-data", str(data_file),
                   "--concurrency-range", str(concurrency), "--max-threads", str(max(16, concurrency)),
                   "--measurement-interval", str(measurement_ms), "--stability-percentage", str(stability_pct),
                   "--max-trials", str(max_trials), "-f", str(report)]
        timeout = 120 + 2 * max_trials * measurement_ms / 1000
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            output = b"".join(part if isinstance(part, bytes) else part.encode() for part in (err.stdout, err.stderr)
                             if part)  # bytes here even with text=True
            raise PerfAnalyzerError(f"perf_analyzer ran past {timeout:.0f} s: {' '.join(command)}\n"
                                    f"{output.decode(errors='replace')}") from err
        if done.returncode != 0 or not report.is_file():
            raise PerfAnalyzerError(f"perf_analyzer exited {done.returncode}: {' '.join(command)}\n"
                                    f"{done.stdout}{done.stderr}")
        with report.open() as handle:
            row = next(csv.DictReader(handle))
    return (_summary(done.stdout), float(row["Inferences/Second"]),
            float(row["p50 latency"]), float(row["p99 latency"]))
