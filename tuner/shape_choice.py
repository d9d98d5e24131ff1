"""Which shapes a tuning round works on (DietCode's joint search, ``tune.Tuner``): the shape
costing the most weighted time (weight x best latency so far) first, then shapes never measured,
by weight, and the smallest shape (a regime of its own) from the start."""

from __future__ import annotations

import random

import numpy as np


def choose_shapes(tuner) -> list[dict]:
    """The shapes ``tuner`` (a ``tune.Tuner``) works on next round."""
    priorities = np.asarray([w * tuner._best_latency(s) for s, w in tuner._weighted()])
    count = min(tuner.options.shapes_per_round, len(tuner.shapes))
    if np.isinf(priorities).any():  # cold start: shapes nobody has estimated, spread by weight x FLOPs
        scale = np.asarray([w * tuner.task.flops(s) for s, w in tuner._weighted()], dtype=float)
        picks = _sample(tuner.rng, scale, count)
    else:
        # The shape costing the most weighted time first; then shapes never measured, by
        # weight, so small shapes (cheap, but served as often) get kernels of their own
        # rather than extrapolations from kernels sized for large ones.
        first = int(np.argmax(priorities))
        unmeasured = np.asarray([0.0 if tuner._measured_here(s) else w for s, w in tuner._weighted()])
        unmeasured[first] = 0
        picks = [first] + _sample(tuner.rng, unmeasured, count - 1)
        if len(picks) < count:
            rest = priorities.copy()
            rest[picks] = 0
            picks += _sample(tuner.rng, rest, count - len(picks))
    smallest = tuner.smallest
    if tuner.weights[smallest] > 0 and not tuner._measured_here(tuner.shapes[smallest]) \
            and smallest not in picks and count > 1:
        # The smallest shape is a regime of its own (weight streaming, no row reuse) that
        # FLOP-weighted picks would reach last: search it from the start.
        picks[-1] = smallest
    return [tuner.shapes[i] for i in picks]


def _sample(rng: random.Random, scale: np.ndarray, count: int) -> list[int]:
    positive = np.flatnonzero(scale > 0)
    if count <= 0 or positive.size == 0:
        return []
    probabilities = scale[positive] / scale[positive].sum()
    generator = np.random.default_rng(rng.randrange(1 << 30))
    return list(generator.choice(positive, size=min(count, positive.size), replace=False, p=probabilities))
