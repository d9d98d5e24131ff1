"""A dense layer's latency as the served model sees it: the weight read from DRAM, not cache.

The tuner times kernels hot (one weight, cached after the first call); the served model's
weights fit no cache, so each call streams its layer's weight from DRAM. A packed kernel passes
over each weight block once per row tile: the first pass reads the block from DRAM, the later
ones from cache. So the first pass takes the longer of the stream and its share of the FMAs:

    served = max(S, hot * first) + hot * (1 - first) + OVERLAP_LOSS * min(S, hot * first)

``hot``: as timed; ``S``: the weight's bytes at the DRAM rate; ``first``: the rows the first
pass computes (1 where the tile covers every row). Where the FMAs outlast the stream the model
is the hot latency: it orders kernels only where the stream matters (short sequences). A
``kc``-blocked reduction, and the untuned kernel (column strips of an unpacked weight), stream
slower than a packed panel read whole (``stream_cost``). The rate met when served moves, so a
kernel is ranked at the sampled rate and at ``1 / RATE_SPREAD`` of it (``served_over_rates``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dietserve.kernels.cpu_packed.kernel import reduces_in_blocks

from .layouts import Estimate, Variant

OVERLAP_LOSS = 0.1  # a first pass's overlap of stream and FMAs falls short by this share of the shorter
BLOCKED_STREAM_COST = 1.2  # a kc-blocked kernel's stream against its whole-reduction twin's
UNPACKED_STREAM_COST = 2.0  # the untuned kernel's stream against a packed tile's
RATE_SPREAD = 2.0  # kernels are ranked at the sampled DRAM rate and at 1 / RATE_SPREAD of it


@dataclass(frozen=True)
class DramRates:
    """The machine's DRAM read rates, bytes/s: a serial kernel streams on one core, slower."""
    every_core: float
    one_core: float

    def __post_init__(self) -> None:
        if not (self.every_core > 0 and self.one_core > 0):
            raise ValueError(f"DRAM read rates must be positive, got {self.every_core} and {self.one_core}")

    def describe(self) -> dict:
        return {"dram_gb_per_s": round(self.every_core / 1e9, 2),
                "dram_gb_per_s_one_core": round(self.one_core / 1e9, 2)}


def weight_bytes(task) -> int | None:
    """Bytes of ``task``'s constant weight as its kernels read it (fp32; bf16 pairs: half), None
    where its operator reads none."""
    from ..ops import weight_input

    index = weight_input(task.spec)
    if index is None:
        return None
    shape = task.spec.input_shapes(task.shapes()[0])[index]
    return math.prod(shape) * (2 if task.spec.precision == "bf16" else 4)


def first_pass_share(kernel: Variant, rows: int) -> float:
    """The share of ``rows`` the first pass over each weight block computes (the untuned kernel's
    passes are unknown: taken as one, its slower stream is ``stream_cost``'s)."""
    if kernel is None or kernel.pack <= 0:
        return 1.0
    return min(1.0, kernel.tile_sizes("i")[0] / max(rows, 1))


def served_latency(hot: float, stream_s: float, first: float) -> float:
    """The latency with the weight from DRAM (the module's model)."""
    overlapped = hot * first
    return max(stream_s, overlapped) + hot * (1.0 - first) + OVERLAP_LOSS * min(stream_s, overlapped)


def stream_cost(kernel: Variant, depth: int) -> float:
    """How much longer than a packed panel's ``kernel``'s weight stream takes."""
    if kernel is None:
        return UNPACKED_STREAM_COST
    return BLOCKED_STREAM_COST if reduces_in_blocks(kernel, depth) else 1.0


def served_over_rates(hot: float, stream_s: float, first: float) -> float:
    """``served_latency`` averaged over the sampled rate and ``RATE_SPREAD`` times slower."""
    return (served_latency(hot, stream_s, first) + served_latency(hot, stream_s * RATE_SPREAD, first)) / 2


def served_estimates(estimate: Estimate, task, rates: DramRates | None) -> Estimate:
    """``estimate`` (weight in cache) as served (``served_over_rates``); ``estimate`` itself where
    the operator has no constant weight or the rates are unknown."""
    nbytes = weight_bytes(task)
    if nbytes is None or rates is None:
        return estimate
    stream_s = {True: nbytes / rates.one_core, False: nbytes / rates.every_core}

    def served(kernel: Variant, shape: dict) -> float:
        hot = estimate(kernel, shape)
        if not math.isfinite(hot):
            return hot
        serial = kernel is not None and kernel.threads == 1
        extents = task.axis_extents(shape)
        stream = stream_s[serial] * stream_cost(kernel, extents["k"])
        return served_over_rates(hot, stream, first_pass_share(kernel, extents["i"]))

    return served

