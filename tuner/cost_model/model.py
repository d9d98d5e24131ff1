"""The cost model: f_microkernel (XGBoost, trained online) x f_adapt (analytic, per shape).

Each measurement of kernel c on shape s gives an *adapted-away* throughput
``flops(s) / latency / f_adapt(c, s)``; f_microkernel learns its log from the kernel's
features. The predicted latency of any (kernel, shape) pair is then
``flops(s) / (f_microkernel(c) * f_adapt(c, s))``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

import numpy as np

from dietserve.kernels.cpu_clamped.kernel import computed_columns, is_clamped, tile_at, tile_lanes
from dietserve.kernels.plan.microkernel import MicroKernel

from .adapt import core_occupancy, kernel_instances, padding_efficiency
from .features import feature_matrix, register_intensity

MIN_SAMPLES = 8  # below this the model predicts nothing and the search explores at random


def adapt(extents: Mapping[str, int], kernel: MicroKernel, cores: int) -> float:
    """f_adapt for the matmul axes (b, i, j, k): padding of i, j (and k where it is tiled)
    times the occupancy of ``b x ceil(i/mc) x ceil(j/nc)`` instances on ``cores``."""
    # Memoised: a plan prices every candidate on every shape (60 x 512 pairs, four plans a tune),
    # and this took 1.6 s of a 27 s tune of one operator.
    return _adapt(tuple(extents.items()), kernel, cores)


@lru_cache(maxsize=1 << 17)
def _adapt(extent_items: tuple, kernel: MicroKernel, cores: int) -> float:
    extents = dict(extent_items)
    cores = 1 if kernel.threads == 1 else cores  # a serial kernel occupies its one core fully
    if is_clamped(kernel):
        # The overlap of a clamped edge tile wastes what padding to whole register tiles would;
        # a task is ``ti`` row tiles (its column tiles run in turn). A shape smaller than the
        # tile runs a smaller one (``tile_at``), one row tile per task, and vectors of as many
        # lanes as its columns: forced (scores, 13-row tile), 8 of 16 lanes ran at the full
        # tile's rate per useful FLOP (T = 13: 100 against 103 GFLOP/s at T = 16), 4 lanes at
        # 0.42 of it (T = 7); scalar code (under 4 columns) far slower. A factor of 1 / 32
        # here, from when every such shape was scalar, made a narrow shape's measurement
        # carry to wider shapes 32x too fast (a plan sent T = 16-20 to a serial kernel
        # estimated at 1 TFLOP/s).
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
        self.cores = cores
        self.seed = seed
        self._kernels: list[MicroKernel] = []
        self._targets: list[float] = []
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
        """f_microkernel: predicted shape-independent FLOP/s. Untrained, a prior from the
        hardware's side of the kernel: proportional to its register tile's FMAs per loaded
        element (so the first proposals are tiles that can reach the FMA rate, and f_adapt
        still sends small shapes to small tiles)."""
        if self._booster is None:
            return np.asarray([register_intensity(kernel) for kernel in kernels], dtype=np.float64)
        import xgboost

        predicted = self._booster.predict(xgboost.DMatrix(feature_matrix(kernels)))
        return np.exp(predicted.astype(np.float64))

    def predict_latency(self, kernels: list[MicroKernel], extents: Mapping[str, int], flops: int) -> np.ndarray:
        throughput = self.kernel_throughput(kernels)
        factors = np.asarray([adapt(extents, kernel, self.cores) for kernel in kernels])
        return flops / (throughput * factors)
