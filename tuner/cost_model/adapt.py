"""f_adapt: how well one micro-kernel fits one concrete shape (DietCode, MLSys 2022), as two
analytic penalties on its shape-independent throughput: the padding to whole tiles
(``computed_extent``) and the idle cores (or SMs) of a last, partial wave of instances."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from dietserve.kernels.cpu_packed.kernel import computed_extent
from dietserve.kernels.plan.microkernel import MicroKernel


def padding_efficiency(shape: Mapping[str, int], kernel: MicroKernel, axes: Iterable[str]) -> float:
    efficiency = 1.0
    for axis in axes:
        extent = shape[axis]
        if extent < 1:
            raise ValueError(f"shape extent of {axis!r} must be positive, got {extent}")
        efficiency *= extent / computed_extent(kernel, axis, extent)
    return efficiency


def kernel_instances(shape: Mapping[str, int], kernel: MicroKernel, parallel_axes: Iterable[str]) -> int:
    """How many micro-kernel instances cover the shape's parallel (spatial) axes."""
    return math.prod(math.ceil(shape[axis] / kernel.tile_of(axis)) for axis in parallel_axes)


def core_occupancy(instances: int, cores: int) -> float:
    if instances < 1 or cores < 1:
        raise ValueError(f"instances and cores must be positive, got {instances} and {cores}")
    return instances / (math.ceil(instances / cores) * cores)


def adapt_factor(shape: Mapping[str, int], kernel: MicroKernel, parallel_axes: Iterable[str],
                 padded_axes: Iterable[str], cores: int) -> float:
    """f_adapt in (0, 1]: multiply f_microkernel's throughput by it to predict this shape's."""
    instances = kernel_instances(shape, kernel, parallel_axes)
    return padding_efficiency(shape, kernel, padded_axes) * core_occupancy(instances, cores)
