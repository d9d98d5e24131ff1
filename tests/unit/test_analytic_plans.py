"""The cold start's planner without building anything: its split of the shapes into runs against
every split enumerated, and its prices against the register-file arithmetic they stand for."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.analytic import DRAM_BYTES_PER_CORE_S, cheapest_runs, packed_seconds, sampled, step_cycles


def brute_force_runs(costs: np.ndarray, most: int) -> float:
    """The least total over every way of cutting the shapes into at most ``most`` runs, each run
    taking the kernel cheapest over it."""
    count = costs.shape[1]
    best = np.inf
    for runs in range(1, most + 1):
        for cuts in itertools.combinations(range(1, count), runs - 1):
            bounds = [0, *cuts, count]
            total = sum(costs[:, start:end].sum(axis=1).min() for start, end in itertools.pairwise(bounds))
            best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_cheapest_runs_match_every_split_enumerated(seed: int) -> None:
    rng = np.random.default_rng(seed)
    costs = rng.uniform(1.0, 2.0, (4, 9))
    for most in (1, 2, 3):
        total, labels = cheapest_runs(costs, most)
        assert total == pytest.approx(brute_force_runs(costs, most))
        assert total == pytest.approx(costs[labels, np.arange(costs.shape[1])].sum())
        assert sum(1 for a, b in itertools.pairwise(labels) if a != b) + 1 <= most


def test_sampled_lengths_keep_every_weight() -> None:
    values = list(range(1, 513))
    weights = list(np.linspace(1.0, 2.0, 512))
    kept, totals = sampled(values, weights)
    assert kept[:64] == values[:64] and kept[-1] <= 512 and len(kept) < len(values) // 2
    assert sum(totals) == pytest.approx(sum(weights))


def test_a_tile_too_small_to_hide_the_fma_latency_is_priced_per_step_at_that_latency() -> None:
    # 2 accumulators cannot keep two 4-cycle FMA pipes busy; 12 can.
    assert step_cycles(1, 2) > step_cycles(6, 2) / 6
    assert step_cycles(6, 2) / 12 < step_cycles(3, 2) / 6


def test_a_dense_layer_of_one_row_is_priced_at_the_dram_rate_of_its_weight() -> None:
    hw = CPU_PRESETS["avx2"]
    one_row = MicroKernel(tile=(("i", (1,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
    seconds = packed_seconds(one_row, 1, 768, 768, hw)
    stream = 768 * 768 * 4 / (DRAM_BYTES_PER_CORE_S * hw.cores)
    assert stream <= seconds < 1.5 * stream
