"""Tuning a packed model's attention kernel over the sequence lengths it serves: DietCode's joint
search, for a kernel whose shape-generic space is small enough to time whole.

Every register tile the hardware allows (``cpu_varlen/tile.py``) is timed, in a measurement
process of its own, in each of the model's attention kernels as served (their masking, shared
heads, and the layers calling each, ``AttentionTask.kernels``), at a few lengths that stand for
the length distribution (the task's weights, from observed traffic, or every length alike): the
lengths split into ``TIMED_LENGTHS`` groups of equal weight, each timed at its median length.
Each sequence then runs the tile its length's group does best, at most ``MAX_TILES`` tiles in
one kernel, chosen to least weighted time (``segment``), as a tree over each sequence's length
compiled into the kernel.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from dietserve.host.hardware import CpuHardware
from dietserve.kernels.cpu_varlen.attention import bf16_attention_fits
from dietserve.kernels.cpu_varlen.tile import LENGTH_VAR, attention_tiles, same_code, tile_for
from dietserve.kernels.plan.attention_plan import AttentionPlan, PlanError
from dietserve.kernels.plan.decision_tree import interval_tree, segment
from dietserve.kernels.plan.task_file import AttentionTask

from .measure.timing import TimingPolicy

TIMED_LENGTHS = 8
MAX_TILES = 3  # leaves of the tree: each is a copy of the kernel's code


def length_groups(task: AttentionTask, count: int = TIMED_LENGTHS) -> list[tuple[int, int, float]]:
    """(the group's longest length, the length it is timed at, its share of the weight), shortest
    first: ``count`` groups of about equal weight (fewer where one length holds more)."""
    weights = np.asarray(task.weights or [1.0] * task.max_len, dtype=float)
    cumulative = np.cumsum(weights) / weights.sum()
    groups, first = [], 0
    for index in range(count):
        last = int(np.searchsorted(cumulative, (index + 1) / count - 1e-9))
        if last < first:
            continue
        median = first + int(np.searchsorted(cumulative[first:last + 1], (index + 0.5) / count - 1e-9))
        share = cumulative[last] - (cumulative[first - 1] if first else 0.0)
        groups.append((last + 1, min(median, last) + 1, float(share)))
        first = last + 1
    groups[-1] = (task.max_len, *groups[-1][1:])  # the last group runs every longer length too
    return groups


def task_digest(task: AttentionTask) -> str:
    """What a plan was timed for besides its heads: the length weights, the shared heads and each
    kernel's masking and layers (a plan timed for other kernels is re-timed)."""
    described = [task.weights, task.kv_heads, [dataclasses.asdict(kernel) for kernel in task.kernels]]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def tiles_job(task: AttentionTask, target: dict, cores: int, tiles: list, lengths: list[int], timing: TimingPolicy,
              precision: str = "fp32") -> dict:
    """The measurement process's job: ``tiles`` built into each of ``task``'s kernels, timed at
    ``lengths``."""
    return {"heads": task.heads, "head_dim": task.head_dim, "max_len": task.max_len, "target": target,
            "threads": cores, "kv_heads": task.kv_heads, "kernels": [dataclasses.asdict(k) for k in task.kernels],
            "tiles": [tile.to_dict() for tile in tiles], "lengths": list(lengths),
            "timing": dataclasses.asdict(timing), "precision": precision}


def measure_tiles(job: dict, timeout_s: float) -> list[dict]:
    """``tuner.measure.attention`` run on ``job`` in a process of its own."""
    command = [sys.executable, "-m", "tuner.measure.attention"]
    try:
        done = subprocess.run(command, input=json.dumps(job), capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"timing the attention tiles took over {timeout_s:.0f} s") from err
    if done.returncode != 0:
        raise RuntimeError(f"the attention measurement process exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def tune_attention(task: AttentionTask, target: dict, hardware: CpuHardware, cores: int, timing: TimingPolicy,
                   tvm_version: str, tuner_version: int, timeout_s: float,
                   say: Callable[[str], None] = lambda _m: None, precision: str = "fp32") -> AttentionPlan:
    """``precision``: the build's; bf16 times the tiles whose products run on bf16 pairs."""
    started = time.monotonic()
    tiles = attention_tiles(hardware, task.head_dim)
    if precision == "bf16":
        tiles = [tile for tile in tiles if bf16_attention_fits(tile, task.head_dim)]
        if not tiles:
            raise PlanError(f"no attention tile runs bf16 products for head_dim {task.head_dim} on {hardware.name}")
    groups = length_groups(task)
    job = tiles_job(task, target, cores, tiles, [timed for _, timed, _ in groups], timing, precision)
    results = measure_tiles(job, timeout_s)
    timed = [(tile, result["latencies"]) for tile, result in zip(tiles, results, strict=True) if "latencies" in result]
    for tile, result in zip(tiles, results, strict=True):
        if "error" in result:
            say(f"attention tile {tile.describe()} failed: {result['error']}")
    if not timed:
        raise PlanError(f"every attention tile failed for {task.heads} heads of {task.head_dim}")
    shares = np.array([share for _, _, share in groups])
    cost = np.array([latencies for _, latencies in timed]) * shares
    labels = segment(cost, MAX_TILES)
    names = [timed[label][0].describe() for label in labels]
    default = tile_for(hardware)
    default_latencies = next((latencies for tile, latencies in timed
                              if same_code(tile, task.head_dim) == same_code(default, task.head_dim)), None)
    entries = []
    for index, (last, length, share) in enumerate(groups):
        entries.append({"length": length, "up_to": last, "weight": round(share, 6), "tile": names[index],
                        "latency_s": timed[labels[index]][1][index],
                        "default_latency_s": None if default_latencies is None else default_latencies[index]})
    chosen = sorted(set(names))
    plan = AttentionPlan(
        heads=task.heads, head_dim=task.head_dim, target=target, tvm_version=tvm_version,
        tiles={name: next(tile for tile, _ in timed if tile.describe() == name).to_dict() for name in chosen},
        tree=interval_tree(LENGTH_VAR, [last for last, _, _ in groups], names), lengths=entries,
        provenance={"tuner": tuner_version, "tiles_timed": len(timed), "tiles_failed": len(tiles) - len(timed),
                    "seconds": round(time.monotonic() - started, 1), "default_tile": default.describe(),
                    "weights": "observed" if task.weights else "uniform", "task_digest": task_digest(task)},
        precision=precision)
    if default_latencies is not None:
        gain = float(np.dot(shares, default_latencies) / np.dot(shares, [e["latency_s"] for e in entries]))
        say(f"attention: {len(timed)} tiles timed at lengths {job['lengths']}; {', '.join(chosen)} chosen, "
            f"{gain:.2f}x the hardware default's {default.describe()} over the weighted lengths")
    return plan
