"""Evolutionary search over the (finite) micro-kernel space, guided by the cost model: a mutation
moves one knob to another value the space has a kernel for, a crossover takes each knob from
one of two parents; each generation keeps the best-scoring half, and a share of the proposals is
drawn at random so the cost model keeps seeing new regions (epsilon-greedy)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import numpy as np

from dietserve.kernels.plan.microkernel import MicroKernel

Score = Callable[[list[MicroKernel]], np.ndarray]  # higher is better


def _knobs(kernel: MicroKernel) -> tuple:
    return (*kernel.tile, kernel.unroll, kernel.vector, kernel.cache_scopes, kernel.threads, kernel.pack, kernel.mma)


def _rebuild(knobs: tuple) -> MicroKernel | None:
    """The kernel of these knobs; None where they do not make one (a tensor-core kind with a
    CUDA-core tile: the space mixes both)."""
    *tile, unroll, vector, scopes, threads, pack, mma = knobs
    try:
        return MicroKernel(tile=tuple(tile), unroll=unroll, vector=vector, cache_scopes=scopes, threads=threads,
                           pack=pack, mma=mma)
    except ValueError:
        return None


class EvolutionarySearch:
    def __init__(self, space: Iterable[MicroKernel], seed: int = 0, population: int = 128, generations: int = 3,
                 epsilon: float = 0.2):
        self.space = list(dict.fromkeys(space))
        if not self.space:
            raise ValueError("the micro-kernel space is empty for this hardware")
        self.members = set(self.space)
        self.rng = random.Random(seed)
        self.population, self.generations, self.epsilon = population, generations, epsilon
        # Per knob position, the values the space uses there.
        self._values = [sorted({_knobs(k)[p] for k in self.space}, key=repr) for p in range(len(_knobs(self.space[0])))]

    def mutate(self, kernel: MicroKernel) -> MicroKernel:
        knobs = list(_knobs(kernel))
        for _attempt in range(8):
            position = self.rng.randrange(len(knobs))
            candidate = list(knobs)
            candidate[position] = self.rng.choice(self._values[position])
            child = _rebuild(tuple(candidate))
            if child in self.members and child != kernel:
                return child
        return self.rng.choice(self.space)

    def crossover(self, first: MicroKernel, second: MicroKernel) -> MicroKernel:
        a, b = _knobs(first), _knobs(second)
        for _attempt in range(4):
            child = _rebuild(tuple(x if self.rng.random() < 0.5 else y for x, y in zip(a, b, strict=False)))
            if child in self.members:
                return child
        return self.mutate(first)

    def propose(self, score: Score, count: int, exclude: set[MicroKernel],
                seeds: Iterable[MicroKernel] = ()) -> list[MicroKernel]:
        """``count`` kernels not in ``exclude``: mostly the best of an evolved population."""
        available = [k for k in self.space if k not in exclude]
        if len(available) <= count:
            return available
        population = list(dict.fromkeys([*seeds, *self.rng.sample(self.space, min(self.population, len(self.space)))]))
        for _generation in range(self.generations):
            scores = score(population)
            ranked = [population[i] for i in np.argsort(-scores)]
            parents = ranked[: max(2, len(ranked) // 2)]
            children = []
            while len(parents) + len(children) < self.population:
                crossover = self.rng.random() < 0.3
                children.append(self.crossover(self.rng.choice(parents), self.rng.choice(parents)) if crossover
                                else self.mutate(self.rng.choice(parents)))
            population = list(dict.fromkeys(parents + children))
        scores = score(population)
        ranked = [population[i] for i in np.argsort(-scores) if population[i] not in exclude]
        greedy = max(0, count - round(count * self.epsilon))
        chosen = list(dict.fromkeys(ranked))[:greedy]
        while len(chosen) < count:
            pick = self.rng.choice(available)
            if pick not in chosen:
                chosen.append(pick)
        return chosen
