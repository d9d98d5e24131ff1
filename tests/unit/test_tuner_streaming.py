"""Timing dense layers with their weight fresh from DRAM, as the served model reads it: enough
copies to outgrow the last-level cache, every copy used in turn, and the worker measuring so."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest

from dietserve.host.hardware import last_level_cache_bytes
from dietserve.kernels.plan.microkernel import MicroKernel
from tuner.database.records import RecordDatabase, TuningRecord
from tuner.measure import worker
from tuner.measure.runner import LocalRunner, MeasureOptions
from tuner.measure.streaming import CACHE_MULTIPLE, UNKNOWN_CACHE_BYTES, SharedCycle, copies, time_streaming
from tuner.ops import dense, random_inputs, weight_input
from tuner.task import ShapeVar, TuningTask
from tuner.tune import TUNER_VERSION, Tuner

MB = 1024 * 1024


def test_copies_outgrow_the_last_level_cache() -> None:
    weight = 3072 * 768 * 4  # bert-base's 3072 -> 768 layer
    count = copies(weight, 32 * MB)
    assert count * weight >= CACHE_MULTIPLE * 32 * MB > (count - 1) * weight
    assert copies(weight, None) == math.ceil(CACHE_MULTIPLE * UNKNOWN_CACHE_BYTES / weight)
    assert copies(10**12, 32 * MB) == 2  # a weight larger than the cache still alternates
    with pytest.raises(ValueError, match="positive"):
        copies(0, 32 * MB)


def test_every_argument_set_is_used_in_turn() -> None:
    calls: list[int] = []
    sets = [(index,) for index in range(5)]
    seconds = time_streaming(calls.append, sets, repeat=3, min_repeat_s=0.0)
    assert seconds >= 0
    assert calls == list(range(5)) * 4  # a first touch of every copy, then one pass per repeat
    with pytest.raises(ValueError):
        time_streaming(calls.append, [], repeat=1, min_repeat_s=0.0)


def test_a_race_cycles_one_cursor_over_the_copies_for_every_kernel() -> None:
    """Kernels raced in turn on weights from DRAM: each call takes the next copy, whichever kernel
    makes it, so no copy is read again before every other one was; a turn lasts at least the
    minimum, and a kernel slower than it makes one call a turn."""
    calls: list[tuple[str, int]] = []

    def kernel(name: str, seconds: float):
        def call(index: int) -> None:
            calls.append((name, index))
            time.sleep(seconds)
        return call

    sets = [(i,) for i in range(5)]
    cycle = SharedCycle(min_turn_s=0.01)
    fast, slow = kernel("fast", 0.0005), kernel("slow", 0.012)
    for _turn in range(3):
        assert cycle.turn(fast, sets) >= 0.0005
        assert cycle.turn(slow, sets) >= 0.012
    assert [index for _name, index in calls] == [i % 5 for i in range(len(calls))]
    made = [name for name, _index in calls]
    assert made.count("slow") == 3 and made.count("fast") >= 6  # (10 ms turns of 0.5 ms calls)


def test_weight_input_is_the_dense_layers_weight() -> None:
    spec = dense(64, 48, "bias_residual")  # inputs: x [T, K], weight [K, N], bias [N], residual [T, N]
    assert weight_input(spec) == 1
    assert spec.input_shapes({"T": 5})[weight_input(spec)] == (64, 48)


def test_the_worker_streams_copies_of_the_weight() -> None:
    """In-process, so the copies it keeps can be inspected: as many as ``copies`` asks for,
    each its own memory, and the measurement still checked and timed."""
    kernel = MicroKernel(tile=(("i", (2,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
    job = {"recipe": ("dense", 64, 48, "bias"), "target": {"kind": "llvm", "num-cores": 2},
           "kernel": kernel.to_json(), "apply": "dietserve.kernels.apply:apply_kernel",
           "shapes": [{"T": 1}, {"T": 7}], "check_shape": {"T": 13}, "device": {"kind": "local"},
           "number": 1, "repeat": 2, "min_repeat_ms": 0, "stream_weights": True}
    result = worker.measure(job)
    assert result["error"] is None, result.get("traceback")
    assert set(result["latencies"]) == {"T=1", "T=7"} and min(result["latencies"].values()) > 0
    kept = next(copies_ for session in worker._SESSIONS.values() for key, copies_ in session.kept.items()
                if key[0] == ("dense", 64, 48, "bias"))
    spec = dense(64, 48, "bias")
    weight = random_inputs(spec, {"T": 1})[weight_input(spec)]
    assert len(kept) == copies(weight.nbytes, last_level_cache_bytes())
    assert len({copy_.data_ptr() for copy_ in kept}) == len(kept)  # each its own memory
    np.testing.assert_array_equal(kept[0].numpy(), kept[-1].numpy())


def test_the_runner_says_how_it_times() -> None:
    assert LocalRunner(MeasureOptions()).describe() == "local" and not LocalRunner().streams_weights
    streaming = LocalRunner(MeasureOptions(stream_weights=True))
    assert streaming.describe() == "local, weights from DRAM" and streaming.streams_weights


def test_records_are_reused_only_where_the_weights_were_alike(tmp_path: Path) -> None:
    """A record timed on a streamed weight is not comparable with one timed on a cached weight
    (4.8x apart at T = 1 on the 3072 -> 768 layer): a tuner reuses only its own kind."""
    task = TuningTask.create(dense(64, 48, "bias"), {"kind": "llvm", "num-cores": 2}, ShapeVar("T", [1, 5]))
    space = [MicroKernel(tile=(("i", (mr, 2)), ("j", (8, 2)), ("k", (1,))), vector=8) for mr in (1, 2)]
    database = RecordDatabase(tmp_path / "records.jsonl")
    for streamed, kernel in ((True, space[0]), (False, space[1])):
        database.append(TuningRecord(workload=task.workload, target=task.target_key, kernel=kernel.to_json(),
                                     shape={"T": 5}, latency_s=1e-4,
                                     meta={"tuner": TUNER_VERSION, "streamed": streamed}))
    for options in (MeasureOptions(stream_weights=True), MeasureOptions()):
        tuner = Tuner(task, space, 2, LocalRunner(options), database)
        (kept,) = tuner.measured[(("T", 5),)]
        assert tuner.reused == 1 and kept == space[0 if options.stream_weights else 1]
