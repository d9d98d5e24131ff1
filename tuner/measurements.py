"""What one tune has measured: each shape's latencies per kernel, the default rule's kernel's
(a variant of None: what an untuned build runs), and the kernels that failed. The phases and the
planner read it through queries; only the tuner writes it (``Tuner.measure``)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping

from dietserve.kernels.plan.microkernel import MicroKernel

from .cost_model.model import adapt

Variant = MicroKernel | None


def shape_key(shape: Mapping[str, int]) -> tuple:
    """A shape as a hashable key (sorted (var, value) pairs), as measurements are indexed."""
    return tuple(sorted(shape.items()))


class Measurements:
    def __init__(self, task, cores: int) -> None:
        self.task = task
        self.cores = cores
        self.kernels: dict[tuple, dict[MicroKernel, float]] = defaultdict(dict)  # shape key -> kernel -> s
        self.default: dict[tuple, float] = {}  # shape key -> the default kernel's seconds
        self.failed: set[MicroKernel] = set()
        self.pending: set[tuple[Variant, tuple]] = set()  # (kernel, shape key) measured elsewhere, not back yet
        self._throughputs: dict[MicroKernel, float] | None = None

    # -- writes (the tuner's) --------------------------------------------------------------
    def add(self, kernel: Variant, shape: Mapping[str, int], latency: float) -> None:
        key = shape_key(shape)
        if kernel is None:
            self.default[key] = min(latency, self.default.get(key, float("inf")))
        else:
            self.kernels[key][kernel] = latency
            self._throughputs = None

    def fail(self, kernel: Variant) -> None:
        if kernel is not None:
            self.failed.add(kernel)

    def pend(self, kernel: Variant, shape: Mapping[str, int]) -> None:
        self.pending.add((kernel, shape_key(shape)))

    # -- queries ---------------------------------------------------------------------------
    def latency(self, kernel: Variant, shape: Mapping[str, int]) -> float | None:
        key = shape_key(shape)
        return self.default.get(key) if kernel is None else self.kernels.get(key, {}).get(kernel)

    def has(self, kernel: Variant, shape: Mapping[str, int]) -> bool:
        """Measured on ``shape``, pending there, or (a kernel) failed: nothing more to learn from
        timing it there."""
        return kernel in self.failed or (kernel, shape_key(shape)) in self.pending \
            or self.latency(kernel, shape) is not None

    def pending_on(self, shape: Mapping[str, int]) -> set[Variant]:
        key = shape_key(shape)
        return {kernel for kernel, pending_key in self.pending if pending_key == key}

    def on(self, shape: Mapping[str, int]) -> dict[MicroKernel, float]:
        """The kernels measured on ``shape`` (a copy)."""
        return dict(self.kernels.get(shape_key(shape), {}))

    def measured_shapes(self) -> list[dict]:
        """Every shape some kernel was measured on."""
        return [dict(key) for key, kernels in self.kernels.items() if kernels]

    def throughputs(self) -> dict[MicroKernel, float]:
        """Each measured kernel's shape-independent throughput: the median over its shapes of
        FLOPs / latency / f_adapt (computed once per new measurement, not per query)."""
        if self._throughputs is None:
            samples: dict[MicroKernel, list[float]] = defaultdict(list)
            for key, kernels in self.kernels.items():
                shape = dict(key)
                extents, flops = self.task.axis_extents(shape), self.task.flops(shape)
                for kernel, latency in kernels.items():
                    samples[kernel].append(flops / latency / adapt(extents, kernel, self.cores))
            self._throughputs = {kernel: statistics.median(values) for kernel, values in samples.items()}
        return self._throughputs

    def estimate(self, kernel: MicroKernel, shape: Mapping[str, int]) -> float:
        """``kernel``'s latency on ``shape``: measured, else its throughput carried by f_adapt."""
        measured = self.latency(kernel, shape)
        if measured is not None:
            return measured
        throughput = self.throughputs().get(kernel)
        if throughput is None:
            return float("inf")
        return self.task.flops(shape) / (throughput * adapt(self.task.axis_extents(shape), kernel, self.cores))
