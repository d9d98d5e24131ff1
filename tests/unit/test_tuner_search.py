"""The search machinery: f_adapt on hand-computed cases, the learned f_microkernel ranks
kernels it was trained on, evolution stays inside the space and finds what the score likes,
shape priorities and the variant/decision-tree selection."""

from __future__ import annotations

import numpy as np
import pytest

from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.plan.decision_tree import interval_tree
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.cpu import cpu_space
from tuner.cost_model.model import CostModel, adapt
from tuner.ops import dense
from tuner.planning.layouts import choose_variants
from tuner.search.evolution import EvolutionarySearch
from tuner.task import ShapeVar, TuningTask

SPACE = cpu_space(CPU_PRESETS["avx2"])


def kernel(mr, ti, nr, tj, kc=1, threads=0) -> MicroKernel:
    return MicroKernel(tile=(("i", (mr, ti)), ("j", (nr, tj)), ("k", (kc,))), vector=8, threads=threads)


def test_adapt_matches_hand_computed_values() -> None:
    extents = {"b": 12, "i": 13, "j": 64, "k": 13}
    k = kernel(4, 2, 16, 2)  # 8 x 32 tiles: rows 13 -> 16 (13/16), columns 64 exact; 12*2*2 = 48 tiles
    assert adapt(extents, k, cores=2) == pytest.approx(13 / 16)
    assert adapt(extents, k, cores=5) == pytest.approx(13 / 16 * 48 / 50)  # 10 waves of 5, 2 idle slots
    padded_k = kernel(4, 2, 16, 2, kc=8)  # reduction 13 -> 16 too
    assert adapt(extents, padded_k, cores=2) == pytest.approx(13 / 16 * 13 / 16)
    assert adapt({"b": 1, "i": 1, "j": 32, "k": 64}, kernel(1, 1, 32, 1, threads=1), cores=64) == 1.0


def synthetic_throughput(k: MicroKernel) -> float:
    """A made-up machine that likes 6-row, 16-wide register tiles and bigger cache tiles."""
    mr, ti = k.tile_sizes("i")
    nr, tj = k.tile_sizes("j")
    return 1e9 * (1 + 4 * (mr == 6) + 3 * (nr == 16) + np.log2(ti * tj))


def test_learned_model_ranks_kernels_like_the_measurements() -> None:
    rng = np.random.default_rng(0)
    train = [SPACE[i] for i in rng.choice(len(SPACE), 200, replace=False)]
    model = CostModel(cores=2)
    extents, flops = {"b": 1, "i": 96, "j": 768, "k": 768}, 2 * 96 * 768 * 768
    for k in train:
        model.add(k, extents, flops, flops / (synthetic_throughput(k) * adapt(extents, k, 2)))
    model.fit()
    assert model.trained
    held_out = [SPACE[i] for i in rng.choice(len(SPACE), 200, replace=False)]
    predicted = model.kernel_throughput(held_out)
    actual = np.asarray([synthetic_throughput(k) for k in held_out])
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    assert np.corrcoef(rank(predicted), rank(actual))[0, 1] > 0.8


def test_evolution_stays_in_the_space_and_finds_high_scores() -> None:
    search = EvolutionarySearch(SPACE, seed=3, epsilon=0.0)
    members = set(SPACE)
    for k in SPACE[:50]:
        assert search.mutate(k) in members
        assert search.crossover(k, SPACE[-1 - SPACE.index(k)]) in members

    def score(kernels):
        return np.asarray([synthetic_throughput(k) for k in kernels])

    proposed = search.propose(score, 8, exclude=set())
    assert len(set(proposed)) == 8 and set(proposed) <= members
    best_possible = max(synthetic_throughput(k) for k in SPACE)
    assert max(synthetic_throughput(k) for k in proposed) >= 0.8 * best_possible
    assert np.mean(score(proposed)) > np.mean(score(SPACE))
    excluded = set(proposed)
    assert not excluded & set(search.propose(score, 8, exclude=excluded))


def test_variants_cover_shapes_and_tree_dispatches_runs() -> None:
    shapes = [{"T": t} for t in (1, 2, 3, 100, 200)]
    small, large = kernel(1, 1, 8, 1), kernel(6, 8, 16, 4)
    latency = {small: [1, 2, 3, 100, 200], large: [10, 10, 10, 20, 30]}

    def estimate(k, shape):
        return latency[k][shapes.index(shape)]

    variants, assignment, best = choose_variants([small, large], shapes, [1] * 5, estimate, max_variants=4)
    assert set(variants) == {small, large}
    assert [variants[a] for a in assignment] == [small, small, small, large, large]
    assert best == [1, 2, 3, 20, 30]
    one, _, _ = choose_variants([small, large], shapes, [1] * 5, estimate, max_variants=1)
    assert one == [large]  # 80 total beats small's 306
    tree = interval_tree("T", [1, 2, 3, 100, 200], ["a", "a", "a", "b", "b"])
    assert tree == {"var": "T", "le": 3, "then": {"variant": "a"}, "else": {"variant": "b"}}


def test_task_instances_weights_and_check_shape() -> None:
    task = TuningTask.create(dense(64, 32), {"kind": "llvm"}, ShapeVar.parse("T", "1:16"), weights=[1.0] * 16)
    assert len(task.instances) == 16 and task.varying() == "T"
    assert task.check_shape() == {"T": 13}  # a prime: no tile divides it
    assert task.axis_extents({"T": 5}) == {"b": 1, "i": 5, "j": 32, "k": 64}
    assert ShapeVar.parse("T", "1:9:4").values == (1, 5, 9)
    with pytest.raises(ValueError, match="weights"):
        TuningTask.create(dense(64, 32), {"kind": "llvm"}, ShapeVar("T", [1, 2]), weights=[1.0])
    with pytest.raises(ValueError, match="cannot parse"):
        ShapeVar.parse("T", "1-512")
