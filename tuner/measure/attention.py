"""Timing a packed model's attention tiles, in a process of its own (``python -m
tuner.measure.attention``: one JSON job on stdin, one JSON answer on stdout), as every candidate
is built and run outside the tuner's process.

Each tile is built, checked against numpy on sequences of mixed lengths, then timed by the
tuner's ``TimingPolicy`` at each length of the job: every tile at one length before the next
length, so drift on a shared host falls on all tiles alike. A run packs ``TIMED_TOKENS`` worth of
sequences of that length (at least one), as a token-budget batch does, and its time is divided
by their number: seconds per sequence.
"""

from __future__ import annotations

import sys

from dietserve.host.startup import keep_torch_out

if __name__ == "__main__":  # a worker process: before TVM is imported
    keep_torch_out()

import json
import math
import traceback

import numpy as np

from .timing import TimingPolicy

TIMED_TOKENS = 512
CHECK_LENGTHS = (1, 13, 64)  # a row, a prime past every tile's rows, a whole number of tiles
CHECK_TOLERANCE = 1e-4  # of the largest output: float32 sums over up to max_len terms
# bf16 products: each operand within 2^-9 of its value, so the outputs within a few 2^-8 of the largest
BF16_CHECK_TOLERANCE = 2e-2


def numpy_attention(qkv: np.ndarray, starts: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Per sequence and head: softmax(q k^T / sqrt(d)) v, in float64."""
    out = np.zeros((qkv.shape[0], heads * head_dim))
    for first, end in zip(starts[:-1], starts[1:], strict=True):
        block = qkv[first:end].astype(np.float64)
        for h in range(heads):
            q, k, v = (block[:, (part * heads + h) * head_dim:(part * heads + h + 1) * head_dim] for part in range(3))
            scores = q @ k.T / math.sqrt(head_dim)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[first:end, h * head_dim:(h + 1) * head_dim] = (weights / weights.sum(axis=1, keepdims=True)) @ v
    return out


def sequences_timed(length: int) -> int:
    return max(1, TIMED_TOKENS // length)


def _arrays(lengths: list[int], heads: int, head_dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    qkv = np.random.default_rng(seed).standard_normal((sum(lengths), 3 * heads * head_dim)).astype(np.float32)
    return qkv, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def measure_tiles(job: dict) -> list[dict]:
    """Per tile of the job: ``{"latencies": [seconds per sequence at each length]}`` or
    ``{"error": message}``."""
    import tvm

    from dietserve.host.cpu import configure_cpu_threads
    from dietserve.kernels.cpu_varlen.attention import varlen_attention
    from dietserve.kernels.cpu_varlen.tile import VarlenTile
    from dietserve.kernels.tir.build import build

    heads, head_dim, max_len = job["heads"], job["head_dim"], job["max_len"]
    target = tvm.target.Target({k: v for k, v in job["target"].items() if k != "host"})
    configure_cpu_threads(job.get("threads"))
    device, timing = tvm.cpu(0), TimingPolicy(**job["timing"])
    check = [min(length, max_len) for length in CHECK_LENGTHS]
    qkv, starts = _arrays(check, heads, head_dim, seed=0)
    expected = numpy_attention(qkv, starts, heads, head_dim)
    precision = job.get("precision", "fp32")
    tolerance = BF16_CHECK_TOLERANCE if precision == "bf16" else CHECK_TOLERANCE
    results, modules = [], {}
    for index, raw in enumerate(job["tiles"]):
        try:
            tile = VarlenTile(**raw)
            func = varlen_attention(heads, head_dim, max_len, tile, precision=precision).with_attr(
                "global_symbol", "main")
            module = build(tvm.IRModule({"main": func}), target).jit()
            out = tvm.runtime.tensor(np.full(expected.shape, np.nan, np.float32), device=device)
            module["main"](tvm.runtime.tensor(qkv, device=device), tvm.runtime.tensor(starts, device=device), out)
            error = np.abs(out.numpy() - expected).max() / np.abs(expected).max()
            if not error < tolerance:
                results.append({"error": f"wrong result on lengths {check}: {error:.3g} of the largest output"})
                continue
            modules[index] = module
            results.append({"latencies": []})
        except Exception as err:  # noqa: BLE001 - a failing tile is a result, not a crash
            results.append({"error": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc(limit=6)})
    for length in job["lengths"]:
        count = sequences_timed(length)
        qkv, starts = _arrays([length] * count, heads, head_dim, seed=length)
        arguments = [tvm.runtime.tensor(qkv, device=device), tvm.runtime.tensor(starts, device=device),
                     tvm.runtime.tensor(np.empty((qkv.shape[0], heads * head_dim), np.float32), device=device)]
        for index, module in modules.items():
            seconds = timing.time(module, device, arguments, None, local=True)
            results[index]["latencies"].append(seconds / count)
    return results


def main() -> None:
    """The job on stdin, the answer on the original stdout; anything else printing (TVM) goes to
    stderr."""
    import os

    answer_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    answer_out.write(json.dumps(measure_tiles(json.loads(sys.stdin.read()))))
    answer_out.flush()


if __name__ == "__main__":
    main()
