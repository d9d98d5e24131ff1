"""Shape-independent features of a micro-kernel, for f_microkernel: generic over targets (the
learned model sorts out what the tile levels mean on CPU and CUDA from measurements)."""

from __future__ import annotations

import math

import numpy as np

from dietserve.kernels.plan.microkernel import MicroKernel

AXES = ("i", "j", "k")
LEVELS = 3  # packed CPU kernels tile j three ways (panel, panels per register tile, per task)
SCOPES = ("local", "shared", "B.local", "clamped")


def register_tile(kernel: MicroKernel) -> tuple[int, int]:
    """Rows and columns of the tile one thread keeps in registers (a packed kernel's spans
    ``pk`` panels)."""
    columns = kernel.tile_sizes("j")
    width = columns[0] * columns[1] if kernel.pack else columns[0]
    return kernel.tile_sizes("i")[0], width


def register_intensity(kernel: MicroKernel) -> float:
    """FMAs per load instruction in one reduction step of the register tile: ``mr`` rows of
    ``v = nr / lanes`` vectors take ``mr * v`` FMAs, ``mr`` broadcasts and ``v`` vector loads,
    so ``mr * v / (mr + v)``: what bounds an inner loop's FLOP rate by its loads."""
    rows, columns = register_tile(kernel)
    vectors = max(columns / max(kernel.vector, 1), 1.0)
    return rows * vectors / (rows + vectors)


def kernel_features(kernel: MicroKernel) -> list[float]:
    features = []
    for axis in AXES:
        sizes = list(kernel.tile_sizes(axis))[:LEVELS]
        sizes += [1] * (LEVELS - len(sizes))
        features += [math.log2(size) for size in sizes]
    inner_i, inner_j = register_tile(kernel)
    features += [
        math.log2(inner_i * inner_j),
        math.log2(kernel.tile_of("i") * kernel.tile_of("j")),
        register_intensity(kernel),
        math.log2(kernel.tile_of("i") * kernel.tile_of("j") / (inner_i * inner_j)),
        float(kernel.unroll),
        float(kernel.vector),
        float(kernel.threads == 1),
        float(kernel.pack),
        float(bool(kernel.mma)),  # tensor cores: another instruction's rate
    ]
    features += [float(scope in kernel.cache_scopes) for scope in SCOPES]
    return features


def feature_matrix(kernels: list[MicroKernel]) -> np.ndarray:
    return np.asarray([kernel_features(kernel) for kernel in kernels], dtype=np.float32)
