"""f_adapt against values computed by hand."""

from __future__ import annotations

import pytest

from dietserve.host.hardware import GPU_PRESETS
from dietserve.kernels.plan.microkernel import MicroKernel
from tuner.cost_model.adapt import adapt_factor, core_occupancy, kernel_instances, padding_efficiency

# A dense [T, K] x [K, N] micro-kernel: 32 x 64 output tile (8x4 and 4x16 per level), K by 8.
KERNEL = MicroKernel(tile=(("T", (8, 4)), ("N", (4, 16)), ("K", (8,))), vector=4)


def test_tile_extent_is_the_product_of_levels() -> None:
    assert (KERNEL.tile_of("T"), KERNEL.tile_of("N"), KERNEL.tile_of("K")) == (32, 64, 8)


@pytest.mark.parametrize(
    "t, expected",
    [
        (128, 1.0),  # whole tiles
        (100, 100 / 128),  # 4 tiles of 32 = 128 rows computed for 100
        (1, 1 / 32),  # one row of a 32-row tile
        (33, 33 / 64),
    ],
)
def test_padding_efficiency(t: int, expected: float) -> None:
    shape = {"T": t, "N": 768, "K": 768}
    assert padding_efficiency(shape, KERNEL, ["T", "N", "K"]) == pytest.approx(expected)


# A packed 13-row kernel: its last row pass runs the shortest remainder tile of 1, 2, 4, 7, 10,
# 12 rows (or the whole 13) that holds the rows left.
PACKED = MicroKernel(tile=(("i", (13,)), ("j", (32, 1, 2)), ("k", (1,))), vector=16, pack=32)


@pytest.mark.parametrize(
    "t, computed",
    [
        (1, 1), (2, 2), (3, 4), (4, 4), (5, 7), (7, 7), (8, 10), (10, 10), (11, 12), (12, 12), (13, 13),
        (14, 14),  # a whole tile, then one row
        (20, 20),  # 13 + 7
        (21, 23),  # 13 + 8 rows on the 10-row tile
        (38, 38),  # 26 + 12 rows on the 12-row tile
        (37, 38),  # 26 + 11 rows on the 12-row tile
    ],
)
def test_packed_rows_end_in_a_remainder_tile(t: int, computed: int) -> None:
    shape = {"i": t, "j": 768, "k": 768}
    assert padding_efficiency(shape, PACKED, ["i", "j"]) == pytest.approx(t / computed)


def test_padding_multiplies_across_axes() -> None:
    shape = {"T": 100, "N": 100, "K": 12}
    # T: 100/128, N: 100/128, K: 12/16
    assert padding_efficiency(shape, KERNEL, ["T", "N", "K"]) == pytest.approx(0.78125 * 0.78125 * 0.75)


def test_occupancy_counts_the_last_partial_wave() -> None:
    assert core_occupancy(48, 132) == pytest.approx(48 / 132)  # one wave, 84 SMs idle
    assert core_occupancy(264, 132) == 1.0  # two full waves
    assert core_occupancy(133, 132) == pytest.approx(133 / 264)  # a second wave of one block
    assert core_occupancy(5, 2) == pytest.approx(5 / 6)


def test_adapt_factor_for_bert_dense_on_h100() -> None:
    h100 = GPU_PRESETS["h100"]
    shape = {"T": 100, "N": 768, "K": 768}
    instances = kernel_instances(shape, KERNEL, ["T", "N"])
    assert instances == 4 * 12
    expected = (100 / 128) * (48 / 132)
    assert adapt_factor(shape, KERNEL, ["T", "N"], ["T", "N", "K"], h100.sm_count) == pytest.approx(expected)


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        padding_efficiency({"T": 0, "N": 64, "K": 8}, KERNEL, ["T"])
    with pytest.raises(ValueError, match="must be positive"):
        core_occupancy(0, 4)
    with pytest.raises(ValueError, match="tile sizes"):
        MicroKernel(tile=(("T", (0,)),))


# Forced runs of the attention scores' 13-row, one-vector clamped kernel (12 heads, d = 64; the
# measurement log, docs/measurements/, "Narrow attention tiles"): GFLOP/s at T = 7, 13 (narrower
# than its 16 columns: 4- and 8-lane tiles) and 16 (its own tile). Data, not a formula: the test is
# that f_adapt carries one shape's rate to another within 2x of what was measured there.
SCORES_KERNEL = MicroKernel(tile=(("i", (13, 1)), ("j", (16,)), ("k", (1,))), vector=16, cache_scopes=("clamped",))
SCORES_GFLOPS = {7: 12 * 7 * 7 * 64 * 2 / 2.3e-6 / 1e9, 13: 12 * 13 * 13 * 64 * 2 / 2.6e-6 / 1e9,
                 16: 12 * 16 * 16 * 64 * 2 / 3.8e-6 / 1e9}


@pytest.mark.parametrize("measured_at, carried_to", [(13, 16), (7, 16), (16, 13), (16, 7), (7, 13)])
def test_narrow_clamped_shapes_carry_within_2x_of_measured(measured_at: int, carried_to: int) -> None:
    from tuner.cost_model.model import adapt

    def factor(t: int) -> float:
        return adapt({"b": 12, "i": t, "j": t, "k": 64}, SCORES_KERNEL, 2)

    carried = SCORES_GFLOPS[measured_at] * factor(carried_to) / factor(measured_at)
    assert 0.5 < carried / SCORES_GFLOPS[carried_to] < 2, (carried, SCORES_GFLOPS[carried_to])
