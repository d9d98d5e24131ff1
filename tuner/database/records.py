"""Tuning records as JSON lines: appended, flushed and fsynced one record at a time, never
rewritten. A crash can leave at most a truncated last line, which reading skips (and counts)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TuningRecord:
    workload: str  # e.g. "dense_bias_gelu[K=768,N=3072]"
    target: str  # ``TuningTask.target_key``
    kernel: str  # MicroKernel.to_json()
    shape: dict  # symbolic var -> value, e.g. {"T": 128}
    latency_s: float | None  # median seconds; None when the candidate failed
    error: str | None = None
    meta: dict = field(default_factory=dict)  # repeats, timestamps, tuner version, ...

    @property
    def ok(self) -> bool:
        return self.latency_s is not None and self.error is None

    def shape_key(self) -> tuple:
        return tuple(sorted(self.shape.items()))


class RecordDatabase:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.skipped_lines = 0  # unreadable lines seen by the last read (a truncated tail)

    def append(self, record: TuningRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(asdict(record), sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as stream:
            # A crash may have left a partial line: start a fresh one so this record stays readable.
            if stream.tell() > 0 and not self._ends_with_newline():
                stream.write("\n")
            stream.write(line)
            stream.flush()
            os.fsync(stream.fileno())

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as stream:
            stream.seek(-1, os.SEEK_END)
            return stream.read(1) == b"\n"

    def records(self) -> Iterator[TuningRecord]:
        self.skipped_lines = 0
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8", errors="replace") as stream:
            for line in stream:
                if not line.strip():
                    continue
                try:
                    yield TuningRecord(**json.loads(line))
                except (json.JSONDecodeError, TypeError):
                    self.skipped_lines += 1


def fastest_per_shape(records: Iterable[TuningRecord]) -> dict[tuple, TuningRecord]:
    """The fastest of ``records`` (successful ones) per shape key."""
    best: dict[tuple, TuningRecord] = {}
    for record in records:
        key = record.shape_key()
        if key not in best or record.latency_s < best[key].latency_s:
            best[key] = record
    return best
