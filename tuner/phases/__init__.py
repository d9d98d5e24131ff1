"""The phases of a tune (seed from the cold start's plan, explore, commit a packing, verify):
each proposes what to measure next and reads the results from the tuner's measurements, until it
has nothing left to propose or its share of the budget is spent (``Tuner.run``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dietserve.kernels.plan.microkernel import MicroKernel

if TYPE_CHECKING:
    from ..tune import Tuner


@dataclass(frozen=True)
class Probe:
    """One measurement to make: ``kernel`` (None: the default rule's kernel) on ``shape``."""

    kernel: MicroKernel | None
    shape: Mapping[str, int]

    def __iter__(self):  # (kernel, shape) = probe
        return iter((self.kernel, self.shape))


class Phase(Protocol):
    def propose(self, tuner: Tuner, until: int) -> list[Probe]:
        """The next probes, in the order to measure them (the tuner stops at ``until`` trials and
        skips what it already measured); empty when the phase is done."""

    def observe(self, tuner: Tuner, results: list[tuple[Probe, float | None]]) -> None:
        """The seconds each probe took (None: it failed), once measured and recorded."""


class BatchPhase(ABC):
    """A phase written as a generator of batches (``batches``), each read after the one before
    was measured; an empty batch is passed over."""

    def __init__(self) -> None:
        self._batches = None

    @abstractmethod
    def batches(self, tuner: Tuner, until: int) -> Iterator[list[Probe]]:
        """The phase's batches of probes, each read after the one before was measured."""

    def propose(self, tuner: Tuner, until: int) -> list[Probe]:
        if self._batches is None:
            self._batches = self.batches(tuner, until)
        return next((batch for batch in self._batches if batch), [])

    def observe(self, tuner: Tuner, results: list[tuple[Probe, float | None]]) -> None:
        tuner.model.fit()


def by_prediction(tuner: Tuner, candidates: list[MicroKernel], shape: Mapping[str, int]) -> list[MicroKernel]:
    """``candidates``, the one the cost model expects to run ``shape`` fastest first."""
    import numpy as np

    task = tuner.task
    predicted = tuner.model.predict_latency(candidates, task.axis_extents(shape), task.flops(shape))
    return [candidates[i] for i in np.argsort(predicted, kind="stable")]
