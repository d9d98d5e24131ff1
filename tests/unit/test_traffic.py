"""The traffic record: decay, the file format and its checks, and the lengths the tuner reads."""

from __future__ import annotations

import json

import pytest

from dietserve.compile.tuning import read_observations
from dietserve.runtime.traffic import Traffic, TrafficError, mix_distance, observed_lengths, observed_tokens


def test_weights_halve_every_half_life_and_tiny_ones_are_forgotten():
    traffic = Traffic(half_life_seconds=10.0, as_of=1000.0)
    for _ in range(4):
        traffic.record(2, 37, now=1000.0)
    traffic.record(1, 300, now=1010.0)  # one half-life later
    assert traffic.weights == {(2, 37): pytest.approx(2.0), (1, 300): pytest.approx(1.0)}
    assert traffic.row_weights() == {37: pytest.approx(4.0), 300: pytest.approx(1.0)}
    traffic.decay_to(1010.0 + 10.0 * 12)  # 2 / 4096 and 1 / 4096 are below the threshold
    assert traffic.weights == {}


def test_the_file_round_trips_and_is_what_tune_reads(tmp_path):
    traffic = Traffic(half_life_seconds=60.0, as_of=0.0)
    for seq, count in ((16, 30), (128, 10)):
        for _ in range(count):
            traffic.record(1, seq, now=0.0)
    traffic.record(4, 128, now=0.0)  # 4 rows at 128
    path = tmp_path / "traffic.json"
    traffic.save(path)
    again = Traffic.load(path)
    assert again.weights == traffic.weights and again.half_life_seconds == 60.0
    lengths = read_observations(path)[0]
    assert len(lengths) == 10_000
    assert lengths.count(16) == pytest.approx(10_000 * 30 / 44, abs=1)
    assert lengths.count(128) == pytest.approx(10_000 * 14 / 44, abs=1)
    assert observed_lengths(Traffic(1.0, 0.0)) == ()
    Traffic(60.0, 0.0).save(path)  # a server that tunes before its first request: every length alike
    assert read_observations(path)[0] == ()
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no positive sequence lengths"):  # a lengths file the user wrote
        read_observations(tmp_path / "empty.txt")


def test_a_packed_execution_counts_each_row_at_its_length_and_its_tokens(tmp_path):
    traffic = Traffic(half_life_seconds=60.0, as_of=0.0)
    for _ in range(3):
        traffic.record_packed((5, 40, 0, 5), now=0.0)  # (a row without tokens counts nowhere)
    traffic.record_packed((100,), now=60.0)  # one half-life later: the earlier ones weigh half
    assert traffic.weights == {(1, 5): 3.0, (1, 40): 1.5, (1, 100): 1.0}
    assert traffic.token_weights == {50: 1.5, 100: 1.0}
    path = tmp_path / "traffic.json"
    traffic.save(path)
    again = Traffic.load(path)
    assert again.weights == traffic.weights and again.token_weights == traffic.token_weights
    tokens = read_observations(path)[1]
    assert len(tokens) == 10_000 and tokens.count(50) == 6_000 and tokens.count(100) == 4_000
    plain = Traffic(60.0, 0.0)
    plain.record(2, 16, now=0.0)
    plain.save(path)  # a padded server's file: no token counts, the tuner weighs by lengths alone
    assert read_observations(path)[1] == () and observed_tokens(plain) == ()
    path.write_text("7 9 11")  # a lengths file the user wrote
    assert read_observations(path)[1] == ()


@pytest.mark.parametrize("content, message", [
    ("{not json", "unreadable"),
    (json.dumps({"format": "something else"}), "not a dietserve traffic file"),
    (json.dumps({"format": "dietserve.traffic", "version": 9}), "version 9"),
    (json.dumps({"format": "dietserve.traffic", "version": 1, "half_life_seconds": 5, "as_of": 0,
                 "shapes": [[0, 5, 1.0]]}), "bad shape entry"),
    (json.dumps({"format": "dietserve.traffic", "version": 1, "as_of": 0, "shapes": []}), "malformed"),
    (json.dumps({"format": "dietserve.traffic", "version": 1, "half_life_seconds": 5, "as_of": 0,
                 "shapes": [[1, 5, "NaN"]]}), "bad shape entry"),
    (json.dumps({"format": "dietserve.traffic", "version": 1, "half_life_seconds": 5, "as_of": 0,
                 "shapes": [], "tokens": [[0, 1.0]]}), "bad tokens entry"),
])
def test_unreadable_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "traffic.json"
    path.write_text(content)
    with pytest.raises(TrafficError, match=message):
        Traffic.load(path)


def test_drift_is_the_share_of_traffic_in_other_buckets():
    edges = [8, 16, 32, 512]
    assert mix_distance({5: 10.0}, {7: 3.0}, edges) == 0.0  # same bucket
    assert mix_distance({5: 1.0}, {300: 1.0}, edges) == 1.0  # disjoint
    assert mix_distance({5: 3.0, 300: 1.0}, {5: 1.0, 300: 1.0}, edges) == pytest.approx(0.25)
    assert mix_distance({1000: 1.0}, {400: 1.0}, edges) == 0.0  # past the last edge: the last bucket
