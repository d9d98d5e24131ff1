"""Plans that measure nothing: each CPU operator's micro-kernels chosen from the hardware model.

DietCode's premise is that the micro-kernels come from hardware limits, not from a shape; this
module also prices them from hardware limits alone, so that a model compiled on a host that has
never been tuned runs register tiles sized for it from the first request. The price of a
micro-kernel on a concrete shape is a closed form (``seconds``):

- its multiply-adds at the rate its register tile sustains: per reduction step, ``h x v`` FMAs
  on ``FMA_PORTS`` ports, never faster than one FMA latency (too few accumulators to hide it) nor
  than its ``h`` broadcasts and ``v`` B vectors through ``LOAD_PORTS`` load ports, plus the
  step's loop (so that of two tiles at the FMA peak the taller wins);
- f_adapt: the padding of the last tiles (a packed kernel's remainder tiles, a clamped kernel's
  narrower tiles) and the idle cores of a last wave of tasks;
- a dense layer's weight streamed from DRAM once per call (a served model's weights outgrow any
  cache), overlapped with the FMAs, at ``DRAM_BYTES_PER_CORE_S`` per working core;
- what a task re-reads from L2 (the activations, overlapped with the FMAs as the weight's
  stream is; a copied B panel) and what waking the thread pool costs, which a serial kernel
  does not pay.

The constants are nominal for a current x86 server core, not measured here: the choice between
kernels depends on their ratios, not on the clock. A plan keeps at most ``MAX_INTERVALS``
intervals of the dispatch value (each one more copy of a kernel to build), chosen by dynamic
programming over the priced shapes. Tuning on the host replaces these plans with measured ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
from tvm import tirx

from ...host.hardware import CpuHardware
from ..cpu_clamped.kernel import PANEL, clamped_fits, tile_at
from ..cpu_packed.amx import amx_tile
from ..cpu_packed.kernel import crowding_rows, packed_tile, remainder_heights
from ..cpu_packed.packing import weight_param, with_precision
from ..cpu_packed.tile import register_footprint
from ..plan.decision_tree import interval_tree, segment
from ..plan.kernel_plan import KernelPlan
from ..plan.microkernel import AMX_BF16, MicroKernel
from ..tir.matching import evaluate, matmul_axes, matmul_extents, symbolic_vars, workload_key
from . import task_space
from .cpu import DTYPE_BYTES, clamped_cpu_space, packed_cpu_space, whole_task_fits_l2

ANALYTIC_SOURCE = "analytic"  # provenance "source" of a plan made here (tuned plans: their records)
CLOCK_HZ = 3.0e9
FMA_PORTS, FMA_LATENCY, LOAD_PORTS = 2, 4, 2
STEP_OVERHEAD = 1  # cycles a reduction step spends on its loop and addresses
DRAM_BYTES_PER_CORE_S = 10e9
L2_BYTES_PER_CYCLE = 32
WAKE_S, TASK_S = 4e-6, 0.1e-6  # waking the thread pool; taking one task
MAX_INTERVALS = 4
# One tdpbf16ps: 16 x 16 sums over 32 reduction steps, issued every 16 cycles (Intel's figure for its
# first AMX cores), so 16x an AVX-512 core's fp32 FMA rate.
AMX_PRODUCT_CYCLES, AMX_PRODUCT_STEPS = 16, 32
DENSE_UP_TO, SAMPLE_STEP = 64, 4  # the values priced: ``sampled``


def step_cycles(rows: int, vectors: int, b_from_l2: bool = False) -> float:
    """Cycles of one reduction step of a ``rows x vectors`` register tile."""
    b_loads = vectors * (2 if b_from_l2 else 1)
    return max(rows * vectors / FMA_PORTS, FMA_LATENCY, (rows + b_loads) / LOAD_PORTS) + STEP_OVERHEAD


def packed_seconds(kernel: MicroKernel, rows: int, cols: int, depth: int, hw: CpuHardware,
                   precision: str = "fp32") -> float:
    """A packed-weight dense layer ``[rows, depth] x [depth, cols]``, its weight from DRAM; bf16:
    a step takes a pair of the reduction's steps, one 4-byte word as an fp32 step's value is (the
    kernel runs over the pairs as over an fp32 reduction half as deep)."""
    if precision == "bf16":
        depth //= 2
    mr, panel, pk, panels = packed_tile(kernel)
    vectors, groups, tasks = pk * panel // hw.lanes(), panels // pk, cols // (panel * panels)
    full, left = divmod(rows, mr)
    cycles = full * step_cycles(mr, vectors)
    if left:  # the remainder tile, widened over the task's groups as far as the registers allow
        height = next(h for h in remainder_heights(mr) if h >= left)
        budget = register_footprint(mr, vectors)
        width = max(w for w in range(1, groups + 1)
                    if groups % w == 0 and register_footprint(height, w * vectors) <= budget)
        cycles += step_cycles(height, width * vectors) / width
    passes = full + (1 if left else 0)
    # the task's activations come from L2 while the FMAs run (prefetched ahead of the tile)
    task_cycles = max(cycles * depth * groups, rows * depth * DTYPE_BYTES / L2_BYTES_PER_CYCLE)
    kc = kernel.tile_sizes("k")[0]
    if 1 < kc < depth:  # the accumulators stored and reloaded between blocks
        task_cycles += (depth // kc - 1) * passes * groups * 2 * mr * vectors / LOAD_PORTS
    workers = 1 if kernel.threads == 1 else min(hw.cores, tasks)
    compute = math.ceil(tasks / workers) * task_cycles / CLOCK_HZ
    stream = depth * cols * DTYPE_BYTES / (DRAM_BYTES_PER_CORE_S * workers)
    if passes > 1 and not whole_task_fits_l2(kernel, depth, hw):
        stream *= passes  # each row pass reads the task's panels again
    return max(compute, stream) + _wake(kernel, tasks)


def amx_seconds(kernel: MicroKernel, rows: int, cols: int, depth: int, hw: CpuHardware) -> float:
    """A bf16 dense layer on AMX tiles (``cpu_packed/amx.py``): one ``tdpbf16ps`` per C tile and
    32 reduction steps at ``AMX_PRODUCT_CYCLES``, the rows padded to whole tiles, the weight's
    bf16 pairs from DRAM as ``packed_seconds`` streams them."""
    mr, panel, pk, panels = packed_tile(kernel)
    row_tiles, column_tiles = amx_tile(kernel)
    tasks = cols // (panel * panels) * -(-rows // mr)
    task_cycles = panels // pk * depth // AMX_PRODUCT_STEPS * row_tiles * column_tiles * AMX_PRODUCT_CYCLES
    workers = 1 if kernel.threads == 1 else min(hw.cores, tasks)
    compute = math.ceil(tasks / workers) * task_cycles / CLOCK_HZ
    stream = depth // 2 * cols * DTYPE_BYTES / (DRAM_BYTES_PER_CORE_S * workers)
    if rows > mr and not whole_task_fits_l2(kernel, depth // 2, hw):
        stream *= -(-rows // mr)
    return max(compute, stream) + _wake(kernel, tasks)


def clamped_seconds(kernel: MicroKernel, batch: int, rows: int, cols: int, depth: int,
                    hw: CpuHardware) -> float:
    """A clamped-tile batched product (attention, pooling): its operands are in cache."""
    height, width = tile_at(kernel, rows, cols)
    lanes = min(width, hw.lanes())
    vectors = -(-width // lanes)
    row_tiles, col_tiles = -(-rows // height), -(-cols // width)
    per_task_tiles = kernel.tile_sizes("i")[1]
    tasks = batch * -(-row_tiles // per_task_tiles)
    copied = PANEL in kernel.cache_scopes
    # B read in place: its rows, a row of the result apart, may crowd one L1 set (and then come
    # from L2 every step); a copied panel is contiguous, at the price of the copy.
    aliased = not copied and _crowded(min(depth, 64), cols * DTYPE_BYTES)
    task_cycles = min(per_task_tiles, row_tiles) * col_tiles * depth * step_cycles(height, vectors, aliased)
    if copied:
        task_cycles += depth * cols * DTYPE_BYTES / L2_BYTES_PER_CYCLE
    workers = 1 if kernel.threads == 1 else min(hw.cores, tasks)
    return math.ceil(tasks / workers) * task_cycles / CLOCK_HZ + _wake(kernel, tasks)


@functools.lru_cache(maxsize=4096)
def _crowded(rows: int, row_bytes: int) -> bool:
    return crowding_rows(rows, row_bytes) is not None


def _wake(kernel: MicroKernel, tasks: int) -> float:
    return 0.0 if kernel.threads == 1 else WAKE_S + tasks * TASK_S


def candidates(func: tirx.PrimFunc, hw: CpuHardware) -> list[MicroKernel]:
    """The CPU space's kernels that fit ``func``: packed where it has a weight, else clamped."""
    if weight_param(func) is not None:
        return task_space(packed_cpu_space(hw), func, hw)
    fits: dict[tuple, bool] = {}  # whether a kernel fits depends on its tile and staging alone

    def fitting(kernel: MicroKernel) -> bool:
        key = (kernel.tile_sizes("i")[0], kernel.tile_sizes("j"), PANEL in kernel.cache_scopes)
        if key not in fits:
            fits[key] = clamped_fits(func, kernel)
        return fits[key]

    return [kernel for kernel in clamped_cpu_space(hw) if fitting(kernel)]


def seconds(kernel: MicroKernel, extents: tuple[int, int, int, int], hw: CpuHardware,
            precision: str = "fp32") -> float:
    """The price of ``kernel`` on the matmul extents ``(batch, rows, cols, depth)``; ``precision``:
    a packed kernel's products' (the others are fp32)."""
    batch, rows, cols, depth = extents
    if kernel.mma == AMX_BF16:
        return amx_seconds(kernel, batch * rows, cols, depth, hw)
    if kernel.pack:
        return packed_seconds(kernel, batch * rows, cols, depth, hw, precision)
    return clamped_seconds(kernel, batch, rows, cols, depth, hw)


def matmul_shape(extents: Sequence, shape: Mapping[str, int]) -> tuple[int, int, int, int]:
    """(batch, rows, cols, depth) of a matmul of ``extents`` (``matmul_extents``) at ``shape``."""
    *batch, i, j, k = [evaluate(extent, shape) for extent in extents]
    return math.prod(batch), i, j, k


def sampled(values: Sequence[int], weights: Sequence[float]) -> tuple[list[int], list[float]]:
    """Every value up to ``DENSE_UP_TO``, then every ``SAMPLE_STEP``-th, each weighing for the
    values up to the next: kernels' prices change slowly with the rows, and pricing every one of
    512 lengths would slow the server's start for nothing."""
    weights = list(weights) if weights else [1.0] * len(values)
    kept = [n for n in range(len(values)) if n < DENSE_UP_TO or (n - DENSE_UP_TO) % SAMPLE_STEP == 0]
    bounds = kept[1:] + [len(values)]
    return [values[n] for n in kept], [sum(weights[n:end]) for n, end in zip(kept, bounds, strict=True)]


def analytic_plan(func: tirx.PrimFunc, operator: str, vary: Mapping, fixed: Mapping[str, int],
                  weights: Sequence[float], target: Mapping, tvm_version: str, hw: CpuHardware,
                  precision: str = "fp32") -> KernelPlan | None:
    """The plan for ``func`` over ``vary``'s values (with ``fixed`` for the other vars), priced
    by ``seconds``; None where no kernel of the space fits it (the default rule stays); for a
    build of ``precision``."""
    kernels = candidates(with_precision(func, precision), hw)
    if not kernels:
        return None
    var = vary["var"]
    values, weight = sampled(list(vary["values"]), weights)
    shapes = [{**fixed, var: value} for value in values]
    weight = np.asarray(weight)
    matmul = matmul_extents(func)
    extents = [matmul_shape(matmul, shape) for shape in shapes]
    costs = np.asarray([[seconds(kernel, extent, hw, precision) for extent in extents] for kernel in kernels])
    # One weight layout per operator: plan each panel width apart, keep the cheapest.
    best = None
    for pack in sorted({kernel.pack for kernel in kernels}):
        rows = [index for index, kernel in enumerate(kernels) if kernel.pack == pack]
        total, labels = cheapest_runs(costs[rows] * weight, MAX_INTERVALS)
        if best is None or total < best[0]:
            best = (total, [rows[label] for label in labels])
    labels = best[1]
    used = list(dict.fromkeys(labels))
    names = {index: f"v{rank}" for rank, index in enumerate(used)}
    axes = matmul_axes(func)
    dispatch_values = [extent[1] for extent in extents]  # the rows: what the tree branches on
    return KernelPlan(
        workload=workload_key(func), operator=operator, shape_vars=sorted(symbolic_vars(func)), axes=axes,
        target=dict(target), tvm_version=tvm_version,
        variants={names[index]: kernels[index].to_dict() for index in used},
        tree=interval_tree(axes["i"], dispatch_values, [names[index] for index in labels]),
        tuned_range={"var": axes["i"], "min": min(dispatch_values), "max": max(dispatch_values)},
        shapes=[{"shape": shape, "value": value, "variant": names[index], "predicted_s": float(costs[index, n])}
                for n, (shape, value, index) in enumerate(zip(shapes, dispatch_values, labels, strict=True))],
        provenance={"source": ANALYTIC_SOURCE, "hardware": dataclasses.asdict(hw), "fixed": dict(fixed)},
        precision=precision)


def cheapest_runs(costs: np.ndarray, most: int) -> tuple[float, list[int]]:
    """Split the shapes (columns, in dispatch order) into at most ``most`` runs, one kernel (row)
    each, at the least total cost (``segment``): (that cost, the kernel of each shape). Only
    kernels among the three cheapest on some shape can be worth a run, so the rest are left out
    of the search."""
    keep = np.unique(np.argsort(costs, axis=0)[:3].ravel())
    labels = [int(keep[label]) for label in segment(costs[keep], most)]
    return float(costs[labels, np.arange(costs.shape[1])].sum()), labels
