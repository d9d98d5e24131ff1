"""The end-to-end benchmark's rounds: the rule for rounds the machine spoiled (``timing.busy_rounds``),
the backends' order per round and the ratio taken within rounds."""

from __future__ import annotations

import statistics

import pytest

from tests.benchmarks.timing import busy_rounds, paired_ratio, rotated


def test_a_round_is_busy_only_where_every_backend_was_slow() -> None:
    samples = {"ours": [10.0, 21.0, 10.5, 20.0], "ort": [14.0, 29.0, 30.0, 28.0], "openvino": [12.0, 25.0, 12.1, 24.0]}
    # Round 2 (index 1) and 4 slowed all three; round 3 slowed ORT alone: a backend's own noise.
    assert busy_rounds(samples, 1.25) == [1, 3]
    assert busy_rounds(samples, 2.5) == []


def test_rounds_must_line_up() -> None:
    with pytest.raises(ValueError, match="round counts"):
        busy_rounds({"ours": [1.0, 2.0], "ort": [1.0]}, 1.25)


def test_every_backend_takes_every_place_in_turn() -> None:
    names = ["untuned", "tuned", "torch", "ort", "openvino"]
    orders = [rotated(names, turn) for turn in range(5)]
    assert orders[0] == names and orders[1] == ["tuned", "torch", "ort", "openvino", "untuned"]
    for place in range(5):
        assert sorted(order[place] for order in orders) == sorted(names)
    assert rotated(names, 7) == orders[2] and rotated([], 3) == []


def test_the_paired_ratio_compares_within_rounds() -> None:
    # A slow spell of the machine from the middle of round 2 (after ORT had run) to the end:
    # ours slow in rounds 2 and 3, ORT in round 3 only; OpenVINO never the faster.
    samples = {"ours": [10.0, 20.0, 20.0], "ort": [12.0, 12.0, 24.0], "openvino": [99.0, 99.0, 99.0]}
    # Per round best/ours: 1.2, 0.6, 1.2. The ratio of the medians pairs ORT's fast round with
    # ours' slow one: 12 / 20.
    assert paired_ratio(samples, "ours", ("ort", "openvino")) == pytest.approx(1.2)
    assert statistics.median(samples["ort"]) / statistics.median(samples["ours"]) == pytest.approx(0.6)
    # The faster rival is taken per round.
    mixed = {"ours": [10.0, 10.0, 10.0], "ort": [9.0, 15.0, 15.0], "openvino": [15.0, 8.0, 16.0]}
    assert paired_ratio(mixed, "ours", ("ort", "openvino")) == pytest.approx(0.9)  # 0.9, 0.8, 1.5
    slower = {"ours": [20.0, 20.0, 20.0], "ort": [12.0, 12.0, 12.0], "openvino": [99.0, 99.0, 99.0]}
    assert paired_ratio(slower, "ours", ("ort", "openvino")) == pytest.approx(0.6)


def test_the_paired_ratio_needs_lined_up_rounds() -> None:
    with pytest.raises(ValueError, match="round counts"):
        paired_ratio({"ours": [1.0, 2.0], "ort": [1.0]}, "ours", ("ort",))
