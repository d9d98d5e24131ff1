"""Append-only tuning records."""

from .records import RecordDatabase, TuningRecord

__all__ = ["RecordDatabase", "TuningRecord"]
