"""Tuning records: append-only JSON lines that survive a truncated last line."""

from __future__ import annotations

import json
from pathlib import Path

from dietserve.kernels.plan.microkernel import MicroKernel
from tuner.database.records import RecordDatabase, TuningRecord, fastest_per_shape

A = MicroKernel(tile=(("T", (4,)), ("N", (16,))), vector=8).to_json()
B = MicroKernel(tile=(("T", (6,)), ("N", (16,))), vector=8).to_json()


def _record(kernel: str, t: int, latency: float | None, error: str | None = None) -> TuningRecord:
    return TuningRecord("dense[K=768,N=768]", "llvm znver3", kernel, {"T": t}, latency, error)


def test_the_fastest_record_per_shape(tmp_path: Path) -> None:
    db = RecordDatabase(tmp_path / "records.jsonl")
    for kernel, t, latency in [(A, 128, 2.0e-3), (B, 128, 1.5e-3), (A, 7, 1e-4), (B, 7, 3e-4), (A, 128, 1.8e-3)]:
        db.append(_record(kernel, t, latency))
    db.append(_record(B, 7, None, error="timeout"))
    best = fastest_per_shape(r for r in db.records() if r.ok)
    assert best[(("T", 128),)].kernel == B and best[(("T", 7),)].kernel == A
    assert best[(("T", 128),)].latency_s == 1.5e-3


def test_truncated_last_line_is_skipped_and_appending_continues(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    db = RecordDatabase(path)
    db.append(_record(A, 64, 1e-3))
    db.append(_record(B, 64, 2e-3))
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 25])  # a crash mid-write of the second record
    assert [r.kernel for r in db.records()] == [A]
    assert db.skipped_lines == 1
    db.append(_record(B, 64, 0.5e-3))
    assert [r.latency_s for r in db.records()] == [1e-3, 0.5e-3]
    assert db.skipped_lines == 1


def test_records_are_only_ever_appended(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    db = RecordDatabase(path)
    db.append(_record(A, 1, 1e-5))
    first = path.read_bytes()
    db.append(_record(B, 1, 2e-5))
    assert path.read_bytes().startswith(first)
    assert json.loads(path.read_text().splitlines()[1])["kernel"] == B
