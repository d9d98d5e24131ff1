"""Append-only tuning records (``records.py``)."""
