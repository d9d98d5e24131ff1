"""A dense layer's latency as the served model sees it: the weight read from DRAM, not from cache.

The tuner times kernels over and over on one weight, which then sits in L2/L3. The served model's
weights (340 MB for bert-base) fit no cache, so each call of a dense layer streams its weight
from DRAM. A packed kernel passes over each weight block once per row tile: the first pass
reads the block from DRAM, the later ones from cache. So the first pass takes the longer of the
block's stream and its own share of the FMAs, and the later passes their share:

    served = max(S, hot * first) + hot * (1 - first) + OVERLAP_LOSS * min(S, hot * first)

where ``hot`` is the latency as timed (weight in cache), ``S`` the weight's bytes at the
machine's DRAM read rate, and ``first`` the share of the rows the first pass computes (1 where
the tile covers every row). The next-block prefetch of the later passes
(``cpu_packed.PREFETCH_NEXT_BLOCK``) is left out: at these lengths it did not show. The
overlap of the first pass is not whole (the first block's wait, the last one's FMAs after the
stream): ``OVERLAP_LOSS`` of the shorter part, which also orders kernels the stream would tie.

Forced kernels of bert-base's 768 -> 3072 layer on a 2-core znver4, the weight (9.4 MB, 0.29 ms
at 33 GB/s) from DRAM (``tests/benchmarks/cold_weights.py``), ms, the model in brackets:
- T = 16: a 5-row tile 0.537, hot 0.382 (0.561); a 9-row tile 0.392, hot 0.351 (0.459);
- T = 20: 5 rows 0.647, hot 0.448 (0.633); 9 rows 0.521, hot 0.447 (0.552);
- T = 11: 5 rows 0.395, hot 0.258 (0.438); 9 rows 0.341, hot 0.244 (0.350); a 14-row tile of
  32-wide panels, one pass, 0.335, hot 0.300 (0.329).
The model is 0.98-1.17x the timings and orders each pair as they ran. Timed with the weight in
cache both tiles ran alike, and a tune that saw only those timings sent T = 15-27 to the 5-row
tile: 1.37x slower than the 9-row one at T = 16 as served.

At long sequences the first pass's FMAs outlast the stream (``hot * first > S``) and the model
is the hot latency: it orders kernels only where the stream matters.

A kernel whose reduction runs in ``kc``-deep blocks (``kc`` < K) reads each panel of its weight
in runs ``kc`` deep, not K: more, shorter streams, each restarting the hardware prefetchers. It
streams ``BLOCKED_STREAM_COST`` times longer. Forced tiles and their whole-reduction twins, the
weight from DRAM (``cold_weights.py``, 7 rounds, znver4; blocked / whole, ms):
- 768x768, 13 rows, kc 384: T = 1 0.048 / 0.041, T = 7 0.060 / 0.047, T = 13 0.090 / 0.078;
- 768 -> 2304, 9 rows, kc 256: T = 4 0.271 / 0.197, T = 7 0.258 / 0.202, T = 9 0.238 / 0.200;
- 768 -> 3072, 14 rows, kc 384: T = 10 0.301 / 0.282, T = 13 0.367 / 0.326, T = 16 0.441 / 0.378;
- 3072 -> 768, 14 rows, kc 384: T = 7 0.279 / 0.289, T = 10 0.333 / 0.303, T = 13 0.392 / 0.354.
Timed hot the twins tie (within 3%, the blocked ones often ahead), so a tune ranking them as timed
picked blocked tiles for short shapes by noise.

The rate a plan meets when served is not the one the tune sampled: on a shared host it moved
2x within minutes (59 -> 32 GB/s within one 40-second timing; a version-25 tune sampled 57.7
GB/s where the end-to-end runs beside it read 32.8-65.4, median 35.7). Which tile is fastest at
T = 11-24 turns on that rate: a tile of two equal row passes ties a taller one when the stream
is fast and loses to it by 10-20% when slow. So a kernel is ranked by its mean served latency
at the sampled rate and at ``1 / RATE_SPREAD`` of it (``served_over_rates``). bert-base, the
version-25 records re-planned that way against their own plans, the same records and rates
(``compare_artifacts.py --lengths 1,7,11,13,16,20,24,31,48,64[,128] --runs 8 --rounds 10
--control``, znver4): 1.012x geomean at a fast moment (seq 1 at 7.05 ms, about 48 GB/s; seq 1
1.063x, 20 1.026x, 16 0.975x), 1.012x at a slow one (seq 1 at 10.2 ms, 33 GB/s; 0.997-1.044x
at every length); the control 0.999x and 0.998x.

The untuned kernel (the default rule's register tiles over the unpacked ``[K, N]`` weight) is
taken as one pass, but it reads the weight in column strips, a short run of each of its K rows,
not as a contiguous panel. From DRAM, the 768x768 layer against a packed 7-row tile
(``cold_weights.py --op dense_768x768 --lengths 1,7 --interleaved --kernel 7,32,1,8,1 --kernel
default --rounds 9``, two runs): T = 1 0.203 / 0.085 ms and 0.107 / 0.074, T = 7 0.293 / 0.090
and 0.222 / 0.075 (hot at T = 1 0.035 against 0.014). Its stream is taken
``UNPACKED_STREAM_COST`` times as long: taken as fast as a packed tile's, it out-ranked a tune's
packed tiles on the short shapes, and the plan ran the 768x768 layer on the untuned kernel at
every length (0.90x end to end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dietserve.kernels.cpu_packed import reduces_in_blocks

from .dispatch import Estimate, Variant, shape_key

# A first pass's overlap of stream and FMAs falls short by about this much of the shorter of the
# two: a 14-row tile at T = 11 (one pass, hot 0.30 ms, stream 0.29) took 0.335 as served, a
# 9-row tile (first pass 0.20 ms of FMAs) 0.341, against 0.30 and 0.33 from a whole overlap.
OVERLAP_LOSS = 0.1
# A kc-blocked kernel's stream, against its whole-reduction twin's (the module docstring's pairs:
# 1.04-1.38x at one pass, about 1.1x at two).
BLOCKED_STREAM_COST = 1.2
# The untuned kernel's stream against a packed tile's (the module docstring: 1.4-3.3x measured;
# 2 keeps it ranked below them where the stream bounds both).
UNPACKED_STREAM_COST = 2.0
# How far below the sampled DRAM rate the served one may be (the module docstring): kernels are
# ranked at the sampled rate and at 1 / RATE_SPREAD of it, equally weighted.
RATE_SPREAD = 2.0


@dataclass(frozen=True)
class DramRates:
    """The machine's DRAM read rates, bytes/s: a serial kernel streams on one core (2-core
    znver4: about 21 GB/s, where both cores read about 31)."""
    every_core: float
    one_core: float

    def __post_init__(self) -> None:
        if not (self.every_core > 0 and self.one_core > 0):
            raise ValueError(f"DRAM read rates must be positive, got {self.every_core} and {self.one_core}")

    def describe(self) -> dict:
        return {"dram_gb_per_s": round(self.every_core / 1e9, 2),
                "dram_gb_per_s_one_core": round(self.one_core / 1e9, 2)}


def weight_bytes(task) -> int | None:
    """Bytes of ``task``'s constant weight (fp32), None where its operator reads none."""
    from .ops import weight_input

    index = weight_input(task.spec)
    if index is None:
        return None
    shape = task.spec.input_shapes(task.shapes()[0])[index]
    return math.prod(shape) * 4


def first_pass_share(kernel: Variant, rows: int) -> float:
    """The share of ``rows`` the first pass over each weight block computes: a packed kernel's
    register tile height over the rows (1: one pass); the untuned kernel's passes are unknown,
    and it is taken as one pass (its slower stream is ``stream_cost``'s)."""
    if kernel is None or kernel.pack <= 0:
        return 1.0
    return min(1.0, kernel.tile_sizes("i")[0] / max(rows, 1))


def served_latency(hot: float, stream_s: float, first: float) -> float:
    """The latency with the weight from DRAM (the module's model): ``hot`` as timed in cache,
    ``stream_s`` the weight's read time, ``first`` the first pass's share of the rows."""
    overlapped = hot * first
    return max(stream_s, overlapped) + hot * (1.0 - first) + OVERLAP_LOSS * min(stream_s, overlapped)


def stream_cost(kernel: Variant, depth: int) -> float:
    """How much longer than a packed panel's ``kernel``'s weight stream takes, by how it reads
    the weight: ``UNPACKED_STREAM_COST`` for the untuned kernel (column strips),
    ``BLOCKED_STREAM_COST`` for a ``kc``-blocked reduction of ``depth``, else 1."""
    if kernel is None:
        return UNPACKED_STREAM_COST
    return BLOCKED_STREAM_COST if reduces_in_blocks(kernel, depth) else 1.0


def served_over_rates(hot: float, stream_s: float, first: float) -> float:
    """``served_latency`` averaged over the rates a plan may meet: ``stream_s`` at the sampled
    rate, and ``RATE_SPREAD`` times as long."""
    return (served_latency(hot, stream_s, first) + served_latency(hot, stream_s * RATE_SPREAD, first)) / 2


def served_estimates(estimate: Estimate, task, rates: DramRates | None,
                     corrections: dict[tuple, dict[Variant, float]] | None = None) -> Estimate:
    """``estimate`` (weight in cache) as served, the weight from DRAM at ``rates`` as sampled
    and as slow as ``RATE_SPREAD`` makes it (``served_over_rates``); the estimate itself where
    the operator has no constant weight or the rates are unknown. ``corrections``: shape key ->
    kernel -> factor on the model there, from kernels raced with the weight from DRAM
    (``race.py``); 1 for the others."""
    nbytes = weight_bytes(task)
    if nbytes is None or rates is None:
        return estimate
    stream_s = {True: nbytes / rates.one_core, False: nbytes / rates.every_core}
    corrections = corrections or {}

    def served(kernel: Variant, shape: dict) -> float:
        hot = estimate(kernel, shape)
        if not math.isfinite(hot):
            return hot
        serial = kernel is not None and kernel.threads == 1
        extents = task.axis_extents(shape)
        stream = stream_s[serial] * stream_cost(kernel, extents["k"])
        factor = corrections.get(shape_key(shape), {}).get(kernel, 1.0) if corrections else 1.0
        return factor * served_over_rates(hot, stream, first_pass_share(kernel, extents["i"]))

    return served


__all__ = ["BLOCKED_STREAM_COST", "OVERLAP_LOSS", "RATE_SPREAD", "UNPACKED_STREAM_COST", "DramRates",
           "first_pass_share", "served_estimates", "served_latency", "served_over_rates", "stream_cost",
           "weight_bytes"]
