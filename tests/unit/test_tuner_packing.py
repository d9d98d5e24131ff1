"""The packing is chosen first, then searched in; the smallest shape keeps a variant of its own.

The tuner runs here against a synthetic machine (latency from a formula, no build): what is
tested is the search's bookkeeping, not a measurement. The real measurements are
``test_tuner_measure.py``'s."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.cpu_clamped.kernel import CLAMPED
from dietserve.kernels.cpu_packed.kernel import computed_extent
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.cpu import clamped_cpu_space, packed_cpu_space
from tuner.cost_model.features import register_tile
from tuner.database.records import RecordDatabase
from tuner.measurements import shape_key
from tuner.ops import attention_context, attention_scores, dense
from tuner.phases import Probe
from tuner.phases.commit import SINGLE_PASS_PROBE_ROWS, CommitPacking, single_pass_probes, width_probes
from tuner.phases.verify import SMALL_REGIME_KERNELS, small_regime_probes
from tuner.planning import estimates
from tuner.planning.estimates import CARRY_PENALTY, FLOOR_MARGIN, nearest_measured_estimates
from tuner.planning.layouts import LAYOUT_TIE, SINGLE_PASS_ROWS, SMALL_REGIME_GAIN, plan_layouts
from tuner.task import ShapeVar, TuningTask
from tuner.tune import TuneOptions, Tuner

from .fake_runner import FakeRunner

TARGET = {"kind": "llvm", "num-cores": 2}


STREAM_S = 3e-5  # the synthetic machine's pass over the weight


def synthetic_latency(kernel: MicroKernel | None, shape) -> float:
    """A kernel takes the longer of one pass over the weight and its compute: packs of 16 run
    at 3/2 the FLOP rate of packs of 24, and tiles of fewer than 4 rows run at ``mr / 4`` of it
    (one row: 0.4; their loads bound them). Rows are computed as the packed kernels compute
    them: whole tiles, then a remainder tile (``computed_extent``), whose padding counts."""
    rows = shape["T"]
    if kernel is None:
        return 1e-3 * rows
    mr = kernel.tile_sizes("i")[0]
    padded = computed_extent(kernel, "i", rows)
    rate = (1.5 if kernel.pack == 16 else 1.0) * (0.4 if mr == 1 else min(1.0, mr / 4))
    return max(STREAM_S, 1e-5 * padded / rate) * (1 + 0.01 * kernel.tile_sizes("j")[2])


def SyntheticMachine() -> FakeRunner:  # noqa: N802 - a machine, as the tests name it
    return FakeRunner(synthetic_latency)


def test_the_packing_is_committed_and_its_small_regime_searched(tmp_path: Path) -> None:
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    machine = SyntheticMachine()
    tuner = Tuner(task, packed_cpu_space(CPU_PRESETS["avx2"]), 2, machine, RecordDatabase(tmp_path / "r.jsonl"),
                  TuneOptions(trials=96, seed=3))
    result = tuner.run()
    assert result.trials == len(machine.jobs) == 96  # the budget, neither more nor less
    assert tuner.packing == 16 == result.plan.pack
    kernels = [k for k in machine.kernels() if k is not None]
    committed_at = next(i for i, k in enumerate(kernels) if all(later.pack == 16 for later in kernels[i:]))
    assert 0 < committed_at < len(kernels) - 10  # both widths searched first, then only one
    assert {k.pack for k in kernels[:committed_at]} == {16, 24}
    one_row = [k for k in tuner.store.kernels[shape_key({"T": 1})] if k.pack == 16 and k.tile_sizes("i")[0] == 1]
    assert one_row, "the smallest shape was never searched in the committed packing"
    t1 = next(row for row in result.plan.shapes if row["value"] == 1)
    # What the plan's T = 1 kernel really costs on the machine: one pass over the weight.
    assert synthetic_latency(result.plan.kernel(t1["variant"]), {"T": 1}) <= STREAM_S * 1.09
    t128 = next(row for row in result.plan.shapes if row["value"] == 128)
    assert result.plan.kernel(t128["variant"]).tile_sizes("i")[0] >= 4


class PackingFlipMachine(FakeRunner):
    """The synthetic machine, but packs of 24 time 4x faster from ``flip`` on (the noise that
    can make a packing measured before the commit look best after it)."""

    def __init__(self) -> None:
        super().__init__(self._latency)
        self.flip = False

    def _latency(self, kernel, shape) -> float:
        faster = self.flip and kernel is not None and kernel.pack == 24
        return synthetic_latency(kernel, shape) / (4 if faster else 1)


def test_the_plan_keeps_to_the_committed_packing(tmp_path: Path) -> None:
    """Kernels of another packing (measured before the commit, or faster by chance) do not take
    the plan away from the committed packing, whose short shapes' tiles were the ones probed."""
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    machine = PackingFlipMachine()
    tuner = Tuner(task, packed_cpu_space(CPU_PRESETS["avx2"]), 2, machine, RecordDatabase(tmp_path / "r.jsonl"),
                  TuneOptions(trials=48, seed=3))
    assert tuner.run().plan.pack == tuner.packing == 16
    machine.flip = True
    other = [k for k in packed_cpu_space(CPU_PRESETS["avx2"]) if k.pack == 24][:4]
    for shape in tuner.shapes[::8]:
        for kernel in other:
            tuner.measure(Probe(kernel, shape))
    plan = tuner.plan()
    assert plan.pack == 16 and all(v is None or v["pack"] == 16 for v in plan.variants.values())
    tuner.packing = None  # uncommitted, the same measurements plan on the faster packing
    assert tuner.plan().pack == 24


def _plan(t1_speedup: float, max_variants: int = 1):
    tall = MicroKernel(tile=(("i", (4,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
    one_row = MicroKernel(tile=(("i", (1,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
    shapes = [{"T": t} for t in range(1, 65)]

    def estimate(kernel, shape):
        t = shape["T"]
        return (1.0 / t1_speedup if t == 1 else float(t)) if kernel is one_row else float(-(-t // 4))

    measured = {shape_key({"T": 1}): {tall: 1.0, one_row: 1.0 / t1_speedup}}
    variants, labels = plan_layouts([tall, one_row], shapes, [1.0] * len(shapes), estimate, measured, {},
                                    max_variants, 4)
    return variants, labels, tall, one_row


def test_the_smallest_shape_keeps_a_variant_of_its_own() -> None:
    variants, labels, tall, one_row = _plan(2 * SMALL_REGIME_GAIN)
    assert variants == [tall, one_row]  # beyond max_variants = 1
    assert variants[labels[0]] is one_row and all(variants[v] is tall for v in labels[1:])
    variants, labels, tall, _ = _plan(SMALL_REGIME_GAIN * 0.9)  # not worth a variant of its own
    assert variants == [tall]


@pytest.fixture
def no_carry_penalty(monkeypatch) -> None:
    """The floors and caps of the estimates alone, without the price of carrying them far."""
    monkeypatch.setattr(estimates, "CARRY_PENALTY", 0.0)


def test_an_estimate_carried_far_is_priced_up_by_the_distance(monkeypatch) -> None:
    """A kernel measured near a shape keeps it from one measured far away and predicted a little
    faster: carried from T = 8 to T = 60, an estimate costs 1 + CARRY_PENALTY x ln(60 / 8)
    times what f_adapt alone gives, and one carried from T = 64 only 1 + CARRY_PENALTY x ln(64 /
    60); without the price the far kernel, 10% faster where it ran, would take T = 60."""
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    near = MicroKernel(tile=(("i", (4,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
    far = MicroKernel(tile=(("i", (4,)), ("j", (16, 1, 2)), ("k", (1,))), vector=8, pack=16)
    measured = {shape_key({"T": 64}): {near: 64e-6}, shape_key({"T": 8}): {far: 8e-6 / 1.1}}
    shapes = ({"T": 60}, {"T": 64})
    priced = nearest_measured_estimates(task, measured, {}, cores=2)
    priced = {(k, s["T"]): priced(k, s) for k in (near, far) for s in shapes}
    monkeypatch.setattr(estimates, "CARRY_PENALTY", 0.0)  # (read when an estimate is made)
    unpriced = nearest_measured_estimates(task, measured, {}, cores=2)
    unpriced = {(k, s["T"]): unpriced(k, s) for k in (near, far) for s in shapes}
    assert priced[far, 60] == pytest.approx(unpriced[far, 60] * (1 + CARRY_PENALTY * math.log(60 / 8)))
    assert priced[near, 60] == pytest.approx(unpriced[near, 60] * (1 + CARRY_PENALTY * math.log(64 / 60)))
    assert priced[near, 64] == unpriced[near, 64] == 64e-6  # measured: as measured
    assert unpriced[far, 60] < unpriced[near, 60] and priced[near, 60] < priced[far, 60]


@pytest.mark.usefixtures("no_carry_penalty")
def test_no_estimate_goes_below_the_smallest_shapes_best() -> None:
    """A kernel measured only on long sequences, carried over to short ones at its GFLOP/s,
    would beat one pass over the weight; the best measured on the smallest shape bounds it."""
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    tall = MicroKernel(tile=(("i", (4,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
    one_row = MicroKernel(tile=(("i", (1,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
    measured = {shape_key({"T": 4}): {one_row: 3e-5}, shape_key({"T": 64}): {tall: 16e-5}}
    estimate = nearest_measured_estimates(task, measured, {}, cores=2)
    assert estimate(tall, {"T": 64}) == 16e-5  # measured: as measured
    assert estimate(tall, {"T": 8}) == pytest.approx(FLOOR_MARGIN * 3e-5)  # carried over: 2e-5, below the floor
    # Below the smallest measured shape no floor is known: 1/32 of the FLOPs, at the same rate
    # (the 4-row tile runs T = 2 on its 2-row remainder tile, no padded row).
    assert estimate(tall, {"T": 2}) == pytest.approx(16e-5 / 32)
    assert estimate(tall, {"T": 128}) > 16e-5


def test_the_smallest_shape_is_probed_in_every_threading_of_the_committed_packing(tmp_path: Path) -> None:
    """A serial one-row kernel measured at T = 1 does not settle the small-T regime: the
    parallel ones are probed too, then the cost model's next best, up to SMALL_REGIME_KERNELS."""
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    tuner = Tuner(task, packed_cpu_space(CPU_PRESETS["avx2"]), 2, SyntheticMachine(),
                  RecordDatabase(tmp_path / "r.jsonl"), TuneOptions(trials=8, seed=3))
    one_row = [k for k in tuner.space if k.pack == 16 and k.tile_sizes("i")[0] == 1]
    serial = next(k for k in one_row if k.threads == 1)
    tuner.store.kernels[shape_key({"T": 1})] = {serial: 1e-4}
    probes = small_regime_probes(tuner, 16)
    assert {shape["T"] for _, shape in probes} == {1}
    kernels = [kernel for kernel, _ in probes]
    assert len(kernels) == SMALL_REGIME_KERNELS - 1 and serial not in kernels
    assert all(k.pack == 16 and k.tile_sizes("i")[0] == 1 for k in kernels)
    assert kernels[0].threads == 0  # the threading not yet measured, first
    for kernel in kernels:
        tuner.store.kernels[shape_key({"T": 1})][kernel] = 1e-4
    assert small_regime_probes(tuner, 16) == []  # enough measured, both threadings among them


def _packed(mr: int) -> MicroKernel:
    return MicroKernel(tile=(("i", (mr,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)


def test_short_shapes_pass_over_the_weight_once() -> None:
    """Up to SINGLE_PASS_ROWS rows a tile covering every row is dispatched, though a shorter
    tile that passes twice is estimated faster (as it times with the weight in cache): in the
    served model the weight comes from DRAM, and the second pass leaves the bus idle."""
    tall, covering = _packed(4), _packed(6)
    shapes = [{"T": t} for t in range(1, 65)]

    def estimate(kernel, shape):  # the 4-row tile is estimated 10% faster everywhere
        return (0.9 if kernel is tall else 1.0) * shape["T"]

    measured = {shape_key({"T": 6}): {covering: 6.0}, shape_key({"T": 8}): {tall: 7.2}}
    rows = [shape["T"] for shape in shapes]
    variants, labels = plan_layouts([tall, covering], shapes, [1.0] * len(shapes), estimate, measured, {}, 1, 2,
                                    rows=rows)
    chosen = {t: variants[label] for t, label in zip(rows, labels, strict=True)}
    assert all(chosen[t] is tall for t in range(1, 5))  # the 4-row tile covers these
    assert chosen[5] is covering and chosen[6] is covering  # two passes of the 4-row tile
    # Past 6 rows no variant covers, and past SINGLE_PASS_ROWS the rule is off: the faster one.
    assert all(chosen[t] is tall for t in range(7, 65))
    assert len(variants) == 2  # the covering kernel beyond max_variants = 1
    # Without the row counts (the rule off), the 4-row tile takes every shape.
    variants, labels = plan_layouts([tall, covering], shapes, [1.0] * len(shapes), estimate, measured, {}, 1, 2)
    assert variants == [tall] and set(labels) == {0}


def test_a_covering_tile_far_behind_is_not_forced() -> None:
    """The single-pass rule holds only where a covering tile is estimated within
    SINGLE_PASS_SLACK of the fastest kernel: a pass saved is not worth a kernel twice as slow
    (a one-core tile, all the tuner had measured covering T = 9-13)."""
    fast, covering = _packed(4), _packed(6)
    shapes = [{"T": t} for t in range(1, 33)]
    rows = [shape["T"] for shape in shapes]
    for behind, forced in ((1.2, True), (2.0, False)):
        def estimate(kernel, shape, behind=behind):
            return (behind if kernel is covering else 1.0) * shape["T"]

        measured = {shape_key({"T": 6}): {covering: 6.0 * behind}, shape_key({"T": 8}): {fast: 8.0}}
        variants, labels = plan_layouts([fast, covering], shapes, [1.0] * len(shapes), estimate, measured, {}, 1, 2,
                                        rows=rows)
        chosen = {t: variants[label] for t, label in zip(rows, labels, strict=True)}
        assert (chosen[5] is covering and chosen[6] is covering) == forced, behind
        assert all(chosen[t] is fast for t in [1, 2, 3, 4, *range(7, 33)])
        if not forced:
            assert variants == [fast]  # the covering tile is not added as a variant


def test_single_pass_tiles_are_probed_on_short_shapes(tmp_path: Path) -> None:
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    tuner = Tuner(task, packed_cpu_space(CPU_PRESETS["avx2"]), 2, SyntheticMachine(),
                  RecordDatabase(tmp_path / "r.jsonl"), TuneOptions(trials=8, seed=3))
    tallest = max(k.tile_sizes("i")[0] for k in tuner.space if k.pack == 16)  # 6 on AVX2's 16 registers
    probes = single_pass_probes(tuner, 16)
    # The rows asked for, the taller ones probed with the packing's tallest tile instead.
    expected = sorted({min(rows, tallest) for rows in SINGLE_PASS_PROBE_ROWS})
    assert [shape["T"] for _, shape in probes] == expected and expected[-1] == tallest < SINGLE_PASS_ROWS
    assert all(k.pack == 16 and k.tile_sizes("i")[0] == shape["T"] for k, shape in probes)
    # the tiles on every core: a single pass is to keep the memory bus busy, which one core cannot
    assert any(k.threads == 1 for k in tuner.space) and all(k.threads != 1 for k, _ in probes)
    for kernel, shape in probes:
        tuner.store.kernels[shape_key(shape)][kernel] = 1e-4
    assert single_pass_probes(tuner, 16) == []  # each measured once: nothing left to probe


def test_avx512_probes_a_tile_as_tall_as_the_single_pass_rule_reaches(tmp_path: Path) -> None:
    """With 32 registers the 32-wide packing's tiles reach 14 rows: every shape the rule covers
    (up to SINGLE_PASS_ROWS) gets a probe at most a third padding, the tallest at the rule's
    last row; the 48-wide packing's tallest (9 rows) stands in for 10 and 13."""
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    tuner = Tuner(task, packed_cpu_space(CPU_PRESETS["avx512"]), 2, SyntheticMachine(),
                  RecordDatabase(tmp_path / "r.jsonl"), TuneOptions(trials=8, seed=3))
    rows = {pack: [shape["T"] for _, shape in single_pass_probes(tuner, pack)] for pack in (32, 48)}
    assert rows == {32: [2, 4, 7, 10, SINGLE_PASS_ROWS], 48: [2, 4, 7, 9]}
    for count in range(2, SINGLE_PASS_ROWS + 1):
        probe = min(r for r in rows[32] if r >= count)
        assert probe - count <= probe / 3


def test_the_single_pass_rule_does_not_choose_the_packing() -> None:
    """Timed with the weight in cache, a covering tile can look slower than two passes of a
    shorter one: the rule applies in the packing the plan takes, or a packing whose covering
    kernels were never measured would win for that alone."""
    tall, covering = _packed(4), _packed(6)
    other = MicroKernel(tile=(("i", (4,)), ("j", (24, 1, 1)), ("k", (1,))), vector=8, pack=24)
    shapes = [{"T": t} for t in range(1, 9)]
    speed = {tall: 0.9, covering: 1.0, other: 0.91}

    def estimate(kernel, shape):
        return speed[kernel] * shape["T"]

    measured = {shape_key({"T": 6}): {covering: 6.0}}
    variants, labels = plan_layouts([tall, covering, other], shapes, [1.0] * 8, estimate, measured, {}, 1, 2,
                                    rows=[s["T"] for s in shapes])
    assert {variants[label] for label in labels} == {tall, covering}  # the 16-wide packing, as without the rule
    assert variants[labels[4]] is covering and variants[labels[5]] is covering


def test_a_tie_between_layouts_goes_to_the_one_covering_more_short_shapes_in_one_pass() -> None:
    """Within LAYOUT_TIE (the measurements' noise) the layout whose tallest tile covers more rows
    takes the plan: the single pass's gain shows only with the weight from DRAM. Past the tie,
    or without the packings' tallest tiles, the least weighted slowdown wins as before."""
    narrow, wide = _packed(4), MicroKernel(tile=(("i", (4,)), ("j", (24, 1, 1)), ("k", (1,))), vector=8, pack=24)
    shapes = [{"T": t} for t in range(1, 65)]
    rows = [s["T"] for s in shapes]
    tallest = {16: 6, 24: 4}  # AVX2: 16-wide tiles reach 6 rows, 24-wide 4

    def plan(wide_speedup: float, **extra):
        def estimate(kernel, shape):
            return shape["T"] / (wide_speedup if kernel is wide else 1.0)

        variants, labels = plan_layouts([narrow, wide], shapes, [1.0] * len(shapes), estimate, {}, {}, 1, 2,
                                        rows=rows, **extra)
        return {variants[label].pack for label in labels}

    inside, outside = 1 + LAYOUT_TIE / 2, 1 + 2 * LAYOUT_TIE
    assert plan(inside, tallest=tallest) == {16}  # a tie: the taller tiles
    assert plan(inside) == {24}  # no tallest tiles known: the least slowdown
    assert plan(outside, tallest=tallest) == {24}  # past the tie
    assert plan(inside, tallest={16: 4, 24: 4}) == {24}  # both reach as far: the least slowdown


def test_a_packed_layout_stays_feasible_where_its_variants_timed_slower_than_the_untuned_kernel() -> None:
    """The guard sends a shape away from a variant measured slower there than the untuned kernel,
    to another variant of the layout. Where the layout has no other, the guard yields: the
    untuned kernel reads the weight unpacked and cannot join a packed plan, so forbidding the
    shape would make the whole packed layout infeasible, and the plan fall back to the untuned
    kernel at every length for one shape where a packed variant timed a little slower."""
    packed, other = _packed(4), _packed(6)
    shapes = [{"T": t} for t in range(1, 17)]
    untuned = {shape_key(s): 3.0 * s["T"] for s in shapes}
    untuned[shape_key({"T": 5})] = 0.96 * 5

    def estimate(kernel, shape):
        if kernel is None:
            return untuned[shape_key(shape)]
        return shape["T"] * (1.0 if kernel is packed else 1.1 if shape["T"] < 12 else 0.8)

    measured = {shape_key(s): {packed: estimate(packed, s)} for s in shapes}
    variants, labels = plan_layouts([packed, None], shapes, [1.0] * 16, estimate, measured, untuned, 4, 8)
    assert [variants[label] for label in labels] == [packed] * 16
    # With another variant in the plan (the faster from T = 12), the guard still sends T = 5 to it.
    variants, labels = plan_layouts([packed, other, None], shapes, [1.0] * 16, estimate, measured, untuned, 4, 8)
    assert [variants[label] for label in labels] == [packed] * 4 + [other] + [packed] * 6 + [other] * 5


def test_a_space_of_one_packing_measures_its_single_pass_tiles_at_commit(tmp_path: Path) -> None:
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    space = [k for k in packed_cpu_space(CPU_PRESETS["avx2"]) if k.pack == 16]
    for trials, heights in ((24, (2, 4, 6)), (8, (2,))):
        machine = SyntheticMachine()
        tuner = Tuner(task, space, 2, machine, RecordDatabase(tmp_path / f"r{trials}.jsonl"),
                      TuneOptions(trials=trials, seed=3))
        tuner.run_phase(CommitPacking(), until=trials)
        kernels = machine.kernels()
        timed = [(k.tile_sizes("i")[0], job.shape["T"]) for k, job in zip(kernels, machine.jobs, strict=True)]
        # Each height on its own shape (AVX2's tallest is 6), within SINGLE_PASS_SHARE of the
        # budget: 3 of 24 trials, 1 of 8.
        assert timed[:len(heights)] == [(rows, rows) for rows in heights]
        # Then each register-tile width not yet measured on the costliest shape (T = 128), on
        # every core, within WIDTH_SHARE of the budget: 1, 2 and 4 panels of 16 at 24 trials,
        # one of them at 8.
        probes = [(register_tile(k)[1], k.threads, job.shape["T"])
                  for k, job in zip(kernels[len(heights):], machine.jobs[len(heights):], strict=True)]
        assert len(probes) == min(3, trials // 8) and {(threads, t) for _, threads, t in probes} == {(0, 128)}
        assert len({width for width, _, _ in probes}) == len(probes)


def test_a_packed_space_probes_every_register_tile_width_on_the_costliest_shape(tmp_path: Path) -> None:
    """After the packing is committed, each register-tile width of it (``pk`` panels) is measured
    on every core on the shape costing the most, the cost model's best of each not measured
    there yet; nothing once all are."""
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    space = [k for k in packed_cpu_space(CPU_PRESETS["avx512"]) if k.pack == 32]
    tuner = Tuner(task, space, 2, SyntheticMachine(), RecordDatabase(tmp_path / "r.jsonl"),
                  TuneOptions(trials=8, seed=3))
    widths = {register_tile(k)[1] for k in space}
    assert widths == {32, 64, 128}
    one_panel = next(k for k in space if register_tile(k)[1] == 32 and k.threads == 0)
    tuner.store.kernels[shape_key({"T": 128})] = {one_panel: 1e-3}
    probes = width_probes(tuner)
    assert {shape["T"] for _, shape in probes} == {128}
    # First each width's tallest tile, one a task, the whole reduction (the measured one-panel
    # kernel is one row tall); then the cost model's best of each width not measured at all.
    tallest = [k for k, _ in probes[:3]]
    assert [register_tile(k)[1] for k in tallest] == [32, 64, 128]
    for kernel in tallest:
        plain = [k for k in space if register_tile(k)[1] == register_tile(kernel)[1]
                 and k.tile_sizes("j")[2] == 1 and k.tile_sizes("k")[0] == 1]
        assert kernel in plain and kernel.tile_sizes("i")[0] == max(k.tile_sizes("i")[0] for k in plain)
    assert {register_tile(k)[1] for k, _ in probes[3:]} <= {64, 128}
    assert all(k.threads == 0 and k in tuner.space for k, _ in probes)
    for kernel, _ in probes:
        tuner.store.kernels[shape_key({"T": 128})][kernel] = 1e-3
    assert width_probes(tuner) == []


def test_a_width_measured_only_in_blocked_or_many_tile_tasks_gets_its_plain_layout_probed(tmp_path: Path) -> None:
    """The costliest shape has each width measured, the 64-wide one only in a blocked reduction
    and in 4-tile tasks (where the plain tile may be the fastest): its plainest layout (one tile
    a task, the whole reduction) is probed there, its tallest tile, and no other width's;
    nothing once it is measured."""
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    space = [k for k in packed_cpu_space(CPU_PRESETS["avx512"]) if k.pack == 32]
    tuner = Tuner(task, space, 2, SyntheticMachine(), RecordDatabase(tmp_path / "r.jsonl"),
                  TuneOptions(trials=8, seed=3))

    def kernel(width: int, groups: int, kc: int) -> MicroKernel:  # (the tallest such tile)
        return max((k for k in space if register_tile(k)[1] == width and k.threads == 0
                    and k.tile_sizes("j")[2] == groups and k.tile_sizes("k")[0] == kc),
                   key=lambda k: k.tile_sizes("i")[0])

    longest = shape_key({"T": 128})
    blocked, many_tiles = kernel(64, 1, 256), kernel(64, 4, 1)
    tuner.store.kernels[longest] = {kernel(32, 1, 1): 1e-3, kernel(128, 1, 1): 1e-3, blocked: 3e-3, many_tiles: 3e-3}
    plain = [k for k in space if register_tile(k)[1] == 64 and k.threads == 0
             and k.tile_sizes("j")[2] == 1 and k.tile_sizes("k")[0] == 1]
    probes = width_probes(tuner)
    assert [shape for _, shape in probes] == [{"T": 128}]
    assert probes[0].kernel in plain and probes[0].kernel.tile_sizes("i")[0] == 6  # 6 x 4 vectors: the registers' most
    tuner.store.kernels[longest][probes[0].kernel] = 1e-3
    assert width_probes(tuner) == []


@pytest.mark.usefixtures("no_carry_penalty")
def test_no_carried_estimate_beats_the_fastest_rate_measured() -> None:
    """A 13-row tile measured only at T = 8 (run on its 10-row remainder tile, 2 rows padding),
    carried to T = 10 by f_adapt, would run at 10/8 of its measured rate; nothing measured ran faster
    than that rate, so the estimate keeps it: 10/8 of the T = 8 latency, not the T = 8 latency."""
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    tall = MicroKernel(tile=(("i", (13,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
    estimate = nearest_measured_estimates(task, {shape_key({"T": 8}): {tall: 3e-5}}, {}, cores=2)
    assert estimate(tall, {"T": 10}) == pytest.approx(10 / 8 * 3e-5)
    # Once something ran faster, the carry may go up to that rate.
    faster = {shape_key({"T": 8}): {tall: 3e-5}, shape_key({"T": 64}): {tall: 64 * 3e-5 / 10},
              shape_key({"T": 1}): {tall: 1e-5}}  # (the floor: 1e-5 from T = 1 on)
    assert nearest_measured_estimates(task, faster, {}, cores=2)(tall, {"T": 10}) == pytest.approx(3e-5)


def _attention_kernel(mr: int, threads: int) -> MicroKernel:
    return MicroKernel(tile=(("i", (mr, 8)), ("j", (16,)), ("k", (1,))), vector=16, cache_scopes=(CLAMPED,),
                       threads=threads)


@pytest.mark.usefixtures("no_carry_penalty")
def test_kernels_on_every_core_are_floored_by_their_own_best_on_the_smallest_shape() -> None:
    """Waking the thread pool costs a kernel on every core more than a tiny shape's work: a
    two-core kernel measured only on long sequences, carried down to T = 1, is not estimated
    below the best two-core kernel measured there (a serial kernel's faster time there does not
    lower it), nor where no two-core kernel was measured on a shape that small; a serial kernel
    keeps the shared floor."""
    task = TuningTask.create(attention_scores(12, 64), TARGET, ShapeVar("T", range(1, 129)))
    serial, parallel, wide = _attention_kernel(4, 1), _attention_kernel(4, 0), _attention_kernel(8, 0)
    measured = {shape_key({"T": 1}): {serial: 2e-7, parallel: 1.5e-6}, shape_key({"T": 128}): {wide: 1e-4}}
    estimate = nearest_measured_estimates(task, measured, {}, cores=2)
    assert estimate(serial, {"T": 1}) == 2e-7 and estimate(parallel, {"T": 1}) == 1.5e-6  # as measured
    floor = FLOOR_MARGIN * 1.5e-6  # carried: 2e-7 at T = 1, 8e-7 at T = 2
    assert estimate(wide, {"T": 1}) == pytest.approx(floor) and estimate(wide, {"T": 2}) == pytest.approx(floor)
    assert estimate(serial, {"T": 2}) < 1.5e-6  # carried from its own T = 1 time, 4 rows padding
    assert estimate(wide, {"T": 128}) == 1e-4
    only_serial = {shape_key({"T": 1}): {serial: 2e-7}, shape_key({"T": 64}): {parallel: 5e-5},
                   shape_key({"T": 128}): {wide: 1e-4}}
    # The smallest shape a two-core kernel was measured on is T = 64: its floor holds from there.
    estimate = nearest_measured_estimates(task, only_serial, {}, cores=2)
    assert estimate(wide, {"T": 64}) == pytest.approx(FLOOR_MARGIN * 5e-5)  # carried: 2.5e-5
    assert estimate(wide, {"T": 1}) == pytest.approx(FLOOR_MARGIN * 2e-7)  # the shared floor only
    variants, labels = plan_layouts([serial, wide], [{"T": t} for t in range(1, 129)], [1.0] * 128,
                                    nearest_measured_estimates(task, measured, {}, cores=2), measured, {}, 4, 4)
    assert variants[labels[0]] is serial  # T = 1: the serial kernel, measured faster than any two-core one


def test_an_unpacked_space_probes_the_smallest_shape_in_every_threading(tmp_path: Path) -> None:
    """Attention's kernels are unpacked: where only serial ones were measured at T = 1, the
    verification probes the best predicted kernel on every core there (any tile), and no more
    once both threadings are measured there."""
    task = TuningTask.create(attention_scores(12, 64), TARGET, ShapeVar("T", range(1, 129)))
    tuner = Tuner(task, clamped_cpu_space(CPU_PRESETS["avx2"]), 2, SyntheticMachine(),
                  RecordDatabase(tmp_path / "r.jsonl"), TuneOptions(trials=8, seed=3))
    serial = next(k for k in tuner.space if k.threads == 1)
    tuner.store.kernels[shape_key({"T": 1})] = {serial: 2e-7}
    probes = small_regime_probes(tuner, 0)
    assert len(probes) == 1 and probes[0].shape == {"T": 1}
    kernel = probes[0].kernel
    assert kernel.threads == 0 and not kernel.pack
    tuner.store.kernels[shape_key({"T": 1})][kernel] = 1e-6
    assert small_regime_probes(tuner, 0) == []


@pytest.mark.usefixtures("no_carry_penalty")
def test_the_kernel_measured_on_the_smallest_shape_keeps_it_over_one_carried_down_to_its_time() -> None:
    """A 12-row tile measured only on long sequences, carried down to T = 1, would look as fast
    there as the one-row kernel measured at the floor's time (it ran 2x slower: one row of two
    vectors a pass); the floor is a bound, so T = 1 stays with the kernel measured there."""
    task = TuningTask.create(dense(768, 3072, "bias_gelu"), TARGET, ShapeVar("T", range(1, 129)))
    tall = MicroKernel(tile=(("i", (12,)), ("j", (32, 1, 4)), ("k", (1,))), vector=16, pack=32)
    one_row = MicroKernel(tile=(("i", (1,)), ("j", (32, 4, 6)), ("k", (1,))), vector=16, pack=32)
    measured = {shape_key({"T": 1}): {one_row: 54e-6}, shape_key({"T": 64}): {tall: 1.5e-3},
                shape_key({"T": 128}): {tall: 3e-3}}
    estimate = nearest_measured_estimates(task, measured, {}, cores=2)
    assert estimate(tall, {"T": 1}) == pytest.approx(FLOOR_MARGIN * 54e-6)  # carried: 2.3e-5
    shapes = [{"T": t} for t in range(1, 129)]
    variants, labels = plan_layouts([tall, one_row], shapes, [1.0] * len(shapes), estimate, measured, {}, 4, 8,
                                    rows=list(range(1, 129)), tallest={32: 12})
    assert variants[labels[0]] is one_row and variants[labels[-1]] is tall


def column_width_latency(kernel: MicroKernel | None, shape) -> float:
    """Attention's context product on a synthetic machine where 16-wide tiles run at 7/5 the
    rate of the others."""
    rows = shape["T"]
    if kernel is None:
        return 2e-8 * rows * rows
    rate = (1.4 if kernel.tile_sizes("j") == (16,) else 1.0) * (0.5 if kernel.threads == 1 else 1.0)
    return 1e-8 * rows * rows / rate


def ColumnWidthMachine() -> FakeRunner:  # noqa: N802
    return FakeRunner(column_width_latency)


def test_an_unpacked_space_probes_every_column_width_on_the_costliest_shape(tmp_path: Path) -> None:
    """A clamped space has no packing to commit: there every column-tile width the space has is
    measured on every core on the shape costing the most (weight x FLOPs), the cost model's
    best of each width not measured there yet, and nothing once all are."""
    task = TuningTask.create(attention_context(12, 64), TARGET, ShapeVar("T", range(1, 257)))
    tuner = Tuner(task, clamped_cpu_space(CPU_PRESETS["avx2"]), 2, ColumnWidthMachine(),
                  RecordDatabase(tmp_path / "r.jsonl"), TuneOptions(trials=8, seed=3))
    widths = {k.tile_sizes("j") for k in tuner.space}
    assert len(widths) >= 4
    eight_wide = next(k for k in tuner.space if k.tile_sizes("j") == (8,) and k.threads == 0)
    tuner.store.kernels[shape_key({"T": 256})] = {eight_wide: 1e-3}
    probes = width_probes(tuner)
    assert {shape["T"] for _, shape in probes} == {256}  # the longest: all shapes weigh the same
    # Each width's tallest tile first (the measured 8-wide one is shorter), then the cost
    # model's best of each width not measured at all.
    tallest = [k for k, _ in probes[:len(widths)]]
    assert sorted(k.tile_sizes("j") for k in tallest) == sorted(widths)
    for kernel in tallest:
        assert kernel.tile_sizes("i")[0] == max(k.tile_sizes("i")[0] for k in tuner.space
                                                 if k.tile_sizes("j") == kernel.tile_sizes("j"))
    assert {k.tile_sizes("j") for k, _ in probes[len(widths):]} <= widths - {(8,)}
    assert all(k.threads == 0 and k in tuner.space for k, _ in probes)
    for kernel, _ in probes:
        tuner.store.kernels[shape_key({"T": 256})][kernel] = 1e-3
    assert width_probes(tuner) == []


def test_a_tune_of_an_unpacked_space_plans_the_fastest_width_at_long_shapes(tmp_path: Path) -> None:
    """Through a whole tune: every width is measured on the longest shape, and the plan runs long
    shapes on the width the machine runs fastest."""
    task = TuningTask.create(attention_context(12, 64), TARGET, ShapeVar("T", range(1, 257)))
    machine = ColumnWidthMachine()
    tuner = Tuner(task, clamped_cpu_space(CPU_PRESETS["avx2"]), 2, machine, RecordDatabase(tmp_path / "r.jsonl"),
                  TuneOptions(trials=40, seed=3))
    result = tuner.run()
    assert result.trials == len(machine.jobs) == 40
    longest = tuner.store.kernels[shape_key({"T": 256})]
    assert {k.tile_sizes("j") for k in longest if k.threads == 0} == {k.tile_sizes("j") for k in tuner.space}
    for row in result.plan.shapes:
        if row["value"] >= 128:
            assert result.plan.kernel(row["variant"]).tile_sizes("j") == (16,), row
