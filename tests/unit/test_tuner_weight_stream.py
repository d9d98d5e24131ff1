"""Plans rank dense kernels as served, their weight read from DRAM (``tuner/weight_stream.py``):
the model of the first pass's stream, the rates it is fed, and a plan it changes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.cpu_packed.kernel import reduces_in_blocks, with_whole_reduction
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.cpu import packed_cpu_space
from tuner.cli import _dram_rates
from tuner.database.records import RecordDatabase
from tuner.measure.dram import dram_read_rate
from tuner.measurements import shape_key
from tuner.ops import attention_scores, dense
from tuner.phases.verify import whole_reduction_probes
from tuner.planning.layouts import plan_layouts
from tuner.planning.weight_stream import (
    BLOCKED_STREAM_COST,
    OVERLAP_LOSS,
    RATE_SPREAD,
    UNPACKED_STREAM_COST,
    DramRates,
    first_pass_share,
    served_estimates,
    served_latency,
    served_over_rates,
    weight_bytes,
)
from tuner.targets import resolve_target
from tuner.task import ShapeVar, TuningTask
from tuner.tune import TuneOptions, Tuner

from .fake_runner import FakeRunner

TARGET = {"kind": "llvm", "num-cores": 2}
GELU_LAYER = dense(768, 3072, "bias_gelu")  # bert-base's 768 -> 3072 layer: a 9.4 MB weight
RATES = DramRates(every_core=33e9, one_core=21e9)


def _packed(mr: int, threads: int = 0) -> MicroKernel:
    return MicroKernel(tile=(("i", (mr,)), ("j", (48, 1, 1)), ("k", (1,))), vector=16, pack=48, threads=threads)


def _task(spec=GELU_LAYER, values=range(1, 65)) -> TuningTask:
    return TuningTask.create(spec, TARGET, ShapeVar("T", values))


def test_the_weight_and_the_first_pass() -> None:
    assert weight_bytes(_task()) == 768 * 3072 * 4
    assert weight_bytes(TuningTask.create(attention_scores(12, 64, 1), TARGET, ShapeVar("T", [4, 8]))) is None
    assert first_pass_share(_packed(9), 16) == 9 / 16
    assert first_pass_share(_packed(9), 7) == 1.0  # the tile covers every row: one pass
    assert first_pass_share(None, 16) == 1.0  # the untuned kernel: taken as one pass


def test_the_model_against_its_own_terms() -> None:
    stream = 0.28
    # One pass, stream-bound: the stream, and a tenth of the FMAs it could not hide.
    assert served_latency(0.1, stream, 1.0) == pytest.approx(stream + OVERLAP_LOSS * 0.1)
    # One pass, compute-bound: the FMAs, and a tenth of the stream.
    assert served_latency(0.5, stream, 1.0) == pytest.approx(0.5 + OVERLAP_LOSS * stream)
    # Four passes: the first streams while a quarter of the FMAs run, the other three compute.
    assert served_latency(0.4, stream, 0.25) == pytest.approx(stream + 0.3 + OVERLAP_LOSS * 0.1)
    # Long sequences: the stream is a small part of the whole; within 1% of the time as timed.
    first = 12.0 * 8 / 512
    assert served_latency(12.0, stream, 8 / 512) == pytest.approx(stream + 12.0 - first + OVERLAP_LOSS * first)
    assert served_latency(12.0, stream, 8 / 512) == pytest.approx(12.0, rel=0.01)


def test_the_model_reproduces_the_cold_timings_it_was_fitted_on() -> None:
    """Forced kernels of the 768 -> 3072 layer timed from DRAM (``cold_weights.py``; the
    measurement log has them): hot, first pass's share, served, at the rate they streamed at."""
    stream = 768 * 3072 * 4 / 33e9
    pairs = [((0.382e-3, 5 / 16, 0.537e-3), (0.351e-3, 9 / 16, 0.392e-3)),  # T = 16: 5 rows, 9 rows
             ((0.448e-3, 5 / 20, 0.647e-3), (0.447e-3, 9 / 20, 0.521e-3)),  # T = 20
             ((0.258e-3, 5 / 11, 0.395e-3), (0.244e-3, 9 / 11, 0.341e-3))]  # T = 11
    for pair in [*pairs, ((0.30e-3, 1.0, 0.335e-3), (0.30e-3, 1.0, 0.335e-3))]:  # a 14-row tile at T = 11
        for hot, first, served in pair:
            assert served_latency(hot, stream, first) == pytest.approx(served, rel=0.2)
    for (hot5, first5, _), (hot9, first9, _) in pairs:  # each pair ordered as it ran, the hot times not
        assert served_latency(hot5, stream, first5) > 1.1 * served_latency(hot9, stream, first9)


def test_served_estimates_stream_on_the_cores_the_kernel_uses() -> None:
    task = _task()
    stream_every, stream_one = weight_bytes(task) / RATES.every_core, weight_bytes(task) / RATES.one_core
    served = served_estimates(lambda kernel, shape: 1e-5, task, RATES)
    # Stream-bound: the stream at the sampled rate and RATE_SPREAD times as long, averaged.
    mean = (1 + RATE_SPREAD) / 2
    assert served(_packed(9), {"T": 4}) == pytest.approx(mean * stream_every + OVERLAP_LOSS * 1e-5)
    assert served(_packed(9, threads=1), {"T": 4}) == pytest.approx(mean * stream_one + OVERLAP_LOSS * 1e-5)
    assert served(_packed(9), {"T": 4}) < served(_packed(9, threads=1), {"T": 4})
    assert served(_packed(9), {"T": 5}) != float("inf")
    # The untuned kernel: one pass, but its column strips of the unpacked weight stream slower.
    assert served(None, {"T": 5}) == pytest.approx(mean * UNPACKED_STREAM_COST * stream_every + OVERLAP_LOSS * 1e-5)
    # Unknown estimates stay unknown; no rates, or no weight: the estimate as it is.
    assert served_estimates(lambda kernel, shape: float("inf"), task, RATES)(_packed(4), {"T": 4}) == float("inf")
    plain = lambda kernel, shape: 1.0  # noqa: E731
    assert served_estimates(plain, task, None) is plain
    attention = TuningTask.create(attention_scores(12, 64, 1), TARGET, ShapeVar("T", [4, 8]))
    assert served_estimates(plain, attention, RATES) is plain
    with pytest.raises(ValueError, match="positive"):
        DramRates(every_core=0.0, one_core=1e9)


def test_the_untuned_kernel_does_not_outrank_blocked_tiles_on_the_stream() -> None:
    """Fastest packed tiles at T = 1 that are kc-blocked (a longer stream) must still rank above
    the untuned kernel, whose unpacked weight streams slower yet: taken as one pass at the packed
    stream's rate, it would take the layer's unpacked layout everywhere."""
    task = TuningTask.create(dense(768, 768, "bias_residual"), TARGET, ShapeVar("T", range(1, 65)))
    blocked = MicroKernel(tile=(("i", (4,)), ("j", (48, 2, 1)), ("k", (256,))), vector=16, pack=48)
    hot = {blocked: 14e-6, None: 34.8e-6}
    slow = DramRates(every_core=35.05e9, one_core=36.11e9)  # that tune's sample
    served = served_estimates(lambda kernel, shape: hot[kernel], task, slow)
    assert served(blocked, {"T": 1}) < served(None, {"T": 1})


def test_kernels_are_ranked_over_the_rates_a_plan_may_meet() -> None:
    """Two passes of 8 rows against one of 14 and one of 2 at T = 16 (the GELU layer, tied hot):
    at a fast stream they tie, at half its rate the taller first pass wins by the stream it
    hides; averaged over both, the taller tile ranks first, as it ran from DRAM."""
    hot, fast = 0.34e-3, 768 * 3072 * 4 / 57.7e9
    halves, tall = 8 / 16, 14 / 16
    assert served_latency(hot, fast, halves) == pytest.approx(served_latency(hot, fast, tall), rel=0.01)
    slow = fast * RATE_SPREAD
    assert served_latency(hot, slow, halves) > 1.15 * served_latency(hot, slow, tall)
    assert served_over_rates(hot, fast, halves) > 1.05 * served_over_rates(hot, fast, tall)
    assert served_over_rates(hot, fast, tall) == pytest.approx(
        (served_latency(hot, fast, tall) + served_latency(hot, slow, tall)) / 2)
    # Where the FMAs hide even the slower stream (long sequences), the hot order stands.
    assert served_over_rates(12.0, fast, 8 / 512) == pytest.approx(12.0, rel=0.01)


def test_a_plan_as_served_passes_over_the_weight_fewer_times() -> None:
    """A 5-row tile timed 5% faster than a 9-row one with the weight in cache (as a tune saw
    bert-base's GELU layer at T = 15-27) reads each weight block four times at T = 16, the
    9-row tile twice: ranked as served, the 9-row tile takes the short shapes; on long ones,
    where the FMAs hide the stream, the faster tile keeps them."""
    short, tall = _packed(5), _packed(9)
    task = _task(values=range(14, 257))
    shapes = task.shapes()

    def hot(kernel, shape):
        return (0.95 if kernel is short else 1.0) * 2.2e-5 * shape["T"]

    measured = {shape_key({"T": 16}): {short: hot(short, {"T": 16}), tall: hot(tall, {"T": 16})}}
    rows = [shape["T"] for shape in shapes]

    def plan(estimate):
        variants, labels = plan_layouts([short, tall], shapes, [1.0] * len(shapes), estimate, measured, {}, 2, 4,
                                        rows=rows)
        return {t: variants[label] for t, label in zip(rows, labels, strict=True)}

    as_timed = plan(hot)
    assert all(as_timed[t] is short for t in rows)
    as_served = plan(served_estimates(hot, task, RATES))
    assert all(as_served[t] is tall for t in range(14, 28))
    assert all(as_served[t] is short for t in range(128, 257))
    # What the model says each costs at T = 16, as served: the 9-row tile faster by a tenth.
    served = served_estimates(hot, task, RATES)
    assert served(short, {"T": 16}) > 1.1 * served(tall, {"T": 16})


def _twins(mr: int, kc: int) -> tuple[MicroKernel, MicroKernel]:
    """A tile with its reduction in ``kc``-deep blocks, and the same tile with the whole one."""
    blocked = MicroKernel(tile=(("i", (mr,)), ("j", (48, 1, 2)), ("k", (kc,))), vector=16, pack=48)
    return blocked, with_whole_reduction(blocked)


def test_a_blocked_reduction_streams_its_weight_slower() -> None:
    """Timed alike with the weight in cache, the blocked twin is ranked slower as served where the
    stream is the first pass's bound, by BLOCKED_STREAM_COST of the stream; where the FMAs hide
    the stream, alike."""
    blocked, whole = _twins(9, 256)
    assert reduces_in_blocks(blocked, 768) and not reduces_in_blocks(whole, 768)
    assert not reduces_in_blocks(_twins(9, 768)[0], 768) and not reduces_in_blocks(None, 768)
    task = _task(values=range(1, 513))
    stream = weight_bytes(task) / RATES.every_core
    served = served_estimates(lambda kernel, shape: 2.2e-5 * shape["T"], task, RATES)
    assert served(blocked, {"T": 7}) == pytest.approx(served_over_rates(2.2e-5 * 7, BLOCKED_STREAM_COST * stream, 1.0))
    assert served(whole, {"T": 7}) == pytest.approx(served_over_rates(2.2e-5 * 7, stream, 1.0))
    assert served(blocked, {"T": 7}) > 1.15 * served(whole, {"T": 7})
    assert served(blocked, {"T": 512}) == pytest.approx(served(whole, {"T": 512}), rel=0.01)


def test_as_served_short_shapes_take_the_whole_reduction_twin(monkeypatch) -> None:
    """Twins timed hot 3% apart, the blocked one ahead (as a tune saw them): ranked as served,
    shapes whose first pass is stream-bound take the whole reduction, long ones keep the
    blocked tile; without the blocked stream's cost, the blocked tile takes every shape."""
    blocked, whole = _twins(9, 256)
    task = _task(values=range(1, 257))
    shapes = task.shapes()
    rows = [shape["T"] for shape in shapes]

    def hot(kernel, shape):  # at T = 16 a little longer than the weight's stream
        return (0.97 if kernel is blocked else 1.0) * 2.2e-5 * shape["T"]

    def plan():
        variants, labels = plan_layouts([blocked, whole], shapes, [1.0] * len(shapes),
                                        served_estimates(hot, task, RATES), {}, {}, 2, 4)
        return {t: variants[label] for t, label in zip(rows, labels, strict=True)}

    served = plan()
    assert all(served[t] is whole for t in range(1, 10))  # one pass, the stream its bound
    # the stream a small part of the whole (even at the slower rate): the 3% ahead hot wins
    assert all(served[t] is blocked for t in range(224, 257))
    monkeypatch.setattr("tuner.planning.weight_stream.BLOCKED_STREAM_COST", 1.0)
    assert set(plan().values()) == {blocked}


def test_a_blocked_tile_on_short_shapes_gets_its_twin_probed(tmp_path: Path) -> None:
    """The plan's verification measures the whole-reduction twin of a blocked tile the plan runs
    on shapes of at most two passes, at the middle such shape, unless measured there; not where
    the plan is ranked as timed (no rates), nor for a blocked tile on long shapes only."""
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 65)))
    # An AVX-512 description whatever this machine is: its 32 registers hold a 9-row tile of
    # 32-wide panels (AVX2's 16 do not).
    space = packed_cpu_space(CPU_PRESETS["avx512"])
    blocked = next(k for k in space if k.pack == 32 and k.tile_sizes("i") == (9,) and k.tile_sizes("k") == (256,)
                   and k.threads == 0)
    twin = with_whole_reduction(blocked)
    assert twin in space and twin != blocked

    def tuner(rates, measured_twin_at=None):
        made = Tuner(task, space, 2, FakeRunner(lambda _k, _s: 1.0), RecordDatabase(tmp_path / "r.jsonl"),
                     TuneOptions(trials=8, dram=rates))
        for t in range(1, 65):  # only the blocked tile measured: the plan runs it everywhere
            made.store.add(blocked, {"T": t}, 1e-5 * t)
        if measured_twin_at is not None:
            made.store.add(twin, {"T": measured_twin_at}, 1.0)
        return made

    served = tuner(RATES)
    # T = 1..18: at most two passes of 9 rows; the probe at the middle one
    assert [tuple(p) for p in whole_reduction_probes(served, served.plan())] == [(twin, {"T": 10})]
    assert whole_reduction_probes(tuner(None), tuner(None).plan()) == []
    done = tuner(RATES, measured_twin_at=10)
    assert whole_reduction_probes(done, done.plan()) == []


def test_the_plan_records_the_rates_it_ranked_with(tmp_path: Path) -> None:
    task = TuningTask.create(dense(64, 96, "bias"), TARGET, ShapeVar("T", range(1, 17)))
    space = packed_cpu_space(resolve_target("llvm", cores=2).hardware)
    for dram, recorded in ((RATES, {"dram_gb_per_s": 33.0, "dram_gb_per_s_one_core": 21.0}), (None, {})):
        machine = FakeRunner(lambda _k, shape: 1e-5 * shape["T"])
        result = Tuner(task, space, 2, machine, RecordDatabase(tmp_path / f"{dram is None}.jsonl"),
                       TuneOptions(trials=8, dram=dram)).run()
        assert {k: v for k, v in result.plan.provenance.items() if k.startswith("dram")} == recorded


def test_the_dram_rate_is_measured_on_the_cores_asked_for() -> None:
    one, both = dram_read_rate(1, 8 * 1024 * 1024, repeat=3), dram_read_rate(2, 8 * 1024 * 1024, repeat=3)
    assert 1e9 < one < 1e12 and 1e9 < both < 1e12  # GB/s, whatever this machine's are
    with pytest.raises(ValueError):
        dram_read_rate(0, None)


def test_the_cli_measures_rates_only_where_plans_need_them() -> None:
    where = resolve_target("llvm", cores=2)
    args = argparse.Namespace(plan_weights="dram", rpc_tracker=None)
    rates = _dram_rates(args, where)
    assert rates is not None and rates.every_core > 0 and rates.one_core > 0
    for change in ({"plan_weights": "cache"}, {"rpc_tracker": "host:9190"}):
        assert _dram_rates(argparse.Namespace(**{**vars(args), **change}), where) is None, change
    assert _dram_rates(args, resolve_target("cuda")) is None
