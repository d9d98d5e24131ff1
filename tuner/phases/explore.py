"""Explore: DietCode's joint search over all shapes of one dynamic operator. Each round picks
shapes by weighted cost (``choose_shapes``); on each it evolves micro-kernels under the cost model
``f_microkernel x f_adapt(shape)`` and proposes the most promising not yet measured there, then
the default rule's kernel (timed after them, against their best). The model is refit each round."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from . import Probe

if TYPE_CHECKING:
    from ..tune import Tuner

SEEDS = 16  # measured kernels, the best estimated on the shape first, that seed the evolution


class Explore:
    def __init__(self) -> None:
        self._round: list[dict] = []
        self._per_shape = 1

    def propose(self, tuner: Tuner, until: int) -> list[Probe]:
        for _attempt in range(2):  # the round's shapes left, then a fresh round
            if not self._round:
                self._round = choose_shapes(tuner)
                self._per_shape = max(1, tuner.options.candidates_per_round // len(self._round))
            while self._round:
                probes = self._probes(tuner, self._round.pop(0), until)
                if probes:
                    return probes
                if not self._round:
                    tuner.model.fit()
        return []  # a whole round found nothing new: the space is exhausted here

    def _probes(self, tuner: Tuner, shape: Mapping[str, int], until: int) -> list[Probe]:
        store = tuner.store
        # The default kernel's trial is kept for it from the start.
        default = int(not store.has(None, shape) and tuner.trials < until)
        extents, flops = tuner.task.axis_extents(shape), tuner.task.flops(shape)

        def score(kernels):
            return -tuner.model.predict_latency(kernels, extents, flops)

        exclude = set(store.on(shape)) | store.failed | store.pending_on(shape)
        seeds = sorted(filter(tuner.searchable, store.throughputs()), key=lambda k: store.estimate(k, shape))[:SEEDS]
        proposed = tuner.search.propose(score, self._per_shape, exclude, seeds)
        proposed = proposed[:max(0, until - tuner.trials - default)]
        return [Probe(kernel, shape) for kernel in proposed] + [Probe(None, shape)] * default

    def observe(self, tuner: Tuner, results: list[tuple[Probe, float | None]]) -> None:
        if not self._round:
            tuner.model.fit()


def choose_shapes(tuner: Tuner) -> list[dict]:
    """The shapes of the next round: the shape costing the most weighted time (weight x best
    latency so far) first, then shapes never measured, by weight, so short shapes (cheap, but
    served as often) get kernels of their own; the smallest shape (a regime of its own: weight
    streaming, no row reuse) from the start. Cold, by weight x FLOPs."""
    pairs = list(zip(tuner.shapes, tuner.weights, strict=True))
    priorities = np.asarray([w * tuner.best_latency(s) for s, w in pairs])
    count = min(tuner.options.shapes_per_round, len(tuner.shapes))
    if np.isinf(priorities).any():
        picks = _sample(tuner.rng, np.asarray([w * tuner.task.flops(s) for s, w in pairs], dtype=float), count)
    else:
        first = int(np.argmax(priorities))
        unmeasured = np.asarray([0.0 if tuner.measured_here(s) else w for s, w in pairs])
        unmeasured[first] = 0
        picks = [first] + _sample(tuner.rng, unmeasured, count - 1)
        if len(picks) < count:
            rest = priorities.copy()
            rest[picks] = 0
            picks += _sample(tuner.rng, rest, count - len(picks))
    smallest = tuner.smallest
    if tuner.weights[smallest] > 0 and not tuner.measured_here(tuner.shapes[smallest]) \
            and smallest not in picks and count > 1:
        picks[-1] = smallest
    return [tuner.shapes[i] for i in picks]


def _sample(rng: random.Random, scale: np.ndarray, count: int) -> list[int]:
    positive = np.flatnonzero(scale > 0)
    if count <= 0 or positive.size == 0:
        return []
    probabilities = scale[positive] / scale[positive].sum()
    generator = np.random.default_rng(rng.randrange(1 << 30))
    return list(generator.choice(positive, size=min(count, positive.size), replace=False, p=probabilities))
