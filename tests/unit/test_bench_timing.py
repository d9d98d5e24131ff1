"""The end-to-end benchmark's rule for rounds the machine spoiled (``timing.busy_rounds``)."""

from __future__ import annotations

import pytest

from tests.benchmarks.timing import busy_rounds


def test_a_round_is_busy_only_where_every_backend_was_slow() -> None:
    samples = {"ours": [10.0, 21.0, 10.5, 20.0], "ort": [14.0, 29.0, 30.0, 28.0], "openvino": [12.0, 25.0, 12.1, 24.0]}
    # Round 2 (index 1) and 4 slowed all three; round 3 slowed ORT alone: a backend's own noise.
    assert busy_rounds(samples, 1.25) == [1, 3]
    assert busy_rounds(samples, 2.5) == []


def test_rounds_must_line_up() -> None:
    with pytest.raises(ValueError, match="round counts"):
        busy_rounds({"ours": [1.0, 2.0], "ort": [1.0]}, 1.25)
