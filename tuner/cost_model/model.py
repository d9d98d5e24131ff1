"""The cost model: f_microkernel (XGBoost, trained online) x f_adapt (analytic, per shape).
f_microkernel learns the log of each measurement's throughput with f_adapt divided out; a
(kernel, shape) pair is then predicted to take ``flops(s) / (f_microkernel(c) * f_adapt(c, s))``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

import numpy as np

from dietserve.kernels.cpu_clamped.kernel import computed_columns, is_clamped, tile_at, tile_lanes
from dietserve.kernels.plan.microkernel import MicroKernel

from .adapt import core_occupancy, kernel_instances, padding_efficiency
from .features import feature_matrix, register_intensity

MIN_SAMPLES = 8  # below this the model stays untrained (``kernel_throughput``'s prior)


def adapt(extents: Mapping[str, int], kernel: MicroKernel, cores: int) -> float:
    """f_adapt for the matmul axes (b, i, j, k): padding of i, j (and k where it is tiled)
    times the occupancy of ``b x ceil(i/mc) x ceil(j/nc)`` instances on ``cores``."""
    # Memoised: a plan prices every candidate on every shape.
    return _adapt(tuple(extents.items()), kernel, cores)


@lru_cache(maxsize=1 << 17)
def _adapt(extent_items: tuple, kernel: MicroKernel, cores: int) -> float:
    extents = dict(extent_items)
    cores = 1 if kernel.threads == 1 else cores  # a serial kernel occupies its one core fully
    if is_clamped(kernel):
        # A clamped edge tile's overlap wastes what padding would; a task is ``ti`` row tiles.
        # A shape smaller than the tile runs a smaller one (``tile_at``), one row tile per task,
        # with vectors as wide as its columns: half-width vectors keep the full rate, narrower
        # ones lose, scalar code most (so narrow shapes' measurements do not carry as too fast).
        height, width = tile_at(kernel, extents["i"], extents["j"])
        rows, columns = extents["i"], extents["j"]
        overlap = rows / (math.ceil(rows / height) * height) \
            * columns / computed_columns(columns, width, tile_lanes(width, kernel.vector))
        whole = (height, width) == (kernel.tile_sizes("i")[0], kernel.tile_sizes("j")[0])
        tile_rows = kernel.tile_of("i") if whole else height
        instances = extents.get("b", 1) * math.ceil(rows / tile_rows)
        vector_lanes = tile_lanes(width, kernel.vector)
        lanes = 1 / (2 * kernel.vector) if width == 1 else min(1.0, 2 * vector_lanes / kernel.vector)
        return overlap * lanes * core_occupancy(instances, cores)
    padded = ("i", "j", "k") if kernel.tile_of("k") > 1 else ("i", "j")
    instances = extents.get("b", 1) * kernel_instances(extents, kernel, ("i", "j"))
    return padding_efficiency(extents, kernel, padded) * core_occupancy(instances, cores)


class CostModel:
    def __init__(self, cores: int, seed: int = 0):
        self.cores, self.seed = cores, seed
        self._kernels: list[MicroKernel] = []
        self._targets: list[float] = []  # log of each measurement's throughput, f_adapt divided out
        self._booster = None

    @property
    def trained(self) -> bool:
        return self._booster is not None

    def add(self, kernel: MicroKernel, extents: Mapping[str, int], flops: int, latency_s: float) -> None:
        throughput = flops / latency_s / adapt(extents, kernel, self.cores)
        self._kernels.append(kernel)
        self._targets.append(math.log(throughput))

    def fit(self) -> None:
        if len(self._targets) < MIN_SAMPLES:
            return
        import xgboost

        data = xgboost.DMatrix(feature_matrix(self._kernels), label=np.asarray(self._targets, dtype=np.float32))
        params = {"max_depth": 5, "eta": 0.15, "subsample": 0.9, "seed": self.seed, "nthread": 1,
                  "objective": "reg:squarederror", "verbosity": 0}
        self._booster = xgboost.train(params, data, num_boost_round=120)

    def kernel_throughput(self, kernels: list[MicroKernel]) -> np.ndarray:
        """f_microkernel: predicted shape-independent FLOP/s. Untrained, a prior proportional to the
        register tile's FMAs per load, so the first proposals are tiles that can reach the FMA rate."""
        if self._booster is None:
            return np.asarray([register_intensity(kernel) for kernel in kernels], dtype=np.float64)
        import xgboost

        predicted = self._booster.predict(xgboost.DMatrix(feature_matrix(kernels)))
        return np.exp(predicted.astype(np.float64))

    def predict_latency(self, kernels: list[MicroKernel], extents: Mapping[str, int], flops: int) -> np.ndarray:
        throughput = self.kernel_throughput(kernels)
        factors = np.asarray([adapt(extents, kernel, self.cores) for kernel in kernels])
        return flops / (throughput * factors)
