"""Timing a packed model's attention tiles, in a process of its own (``python -m
tuner.measure.attention``: one JSON job on stdin, one JSON answer on stdout), as every candidate
is built and run outside the tuner's process.

Each tile is built into each of the job's kernels (their masking and shared heads, as served),
checked against numpy on sequences of mixed lengths, then timed by the tuner's ``TimingPolicy``
at each length of the job: every tile at one length before the next length, so drift on a
shared host falls on all tiles alike. A tile's time there is its kernels' mean over the layers
calling each. A run packs ``TIMED_TOKENS`` worth of
sequences of that length (at least one), as a token-budget batch does, and its time is divided
by their number: seconds per sequence.
"""

from __future__ import annotations

import sys

from dietserve.host.startup import keep_torch_out

if __name__ == "__main__":  # a worker process: before TVM is imported
    keep_torch_out()

import functools
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


def numpy_attention(qkv: np.ndarray, starts: np.ndarray, heads: int, head_dim: int, kv_heads: int | None = None,
                    bias: np.ndarray | None = None) -> np.ndarray:
    """Per sequence and head: softmax(q k^T / sqrt(d) + bias by key - query) v, in float64; query
    head h reads key and value head h // (heads / kv_heads); ``bias`` ``[heads, 2 * max_len - 1]``."""
    kv_heads = kv_heads or heads
    out = np.zeros((qkv.shape[0], heads * head_dim))
    for first, end in zip(starts[:-1], starts[1:], strict=True):
        block = qkv[first:end].astype(np.float64)
        for h in range(heads):
            columns = [h, heads + h // (heads // kv_heads), heads + kv_heads + h // (heads // kv_heads)]
            q, k, v = (block[:, c * head_dim:(c + 1) * head_dim] for c in columns)
            scores = q @ k.T / math.sqrt(head_dim)
            if bias is not None:
                positions = np.arange(end - first)
                scores += bias[h][positions[None, :] - positions[:, None] + (bias.shape[1] + 1) // 2 - 1]
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[first:end, h * head_dim:(h + 1) * head_dim] = (weights / weights.sum(axis=1, keepdims=True)) @ v
    return out


def sequences_timed(length: int) -> int:
    return max(1, TIMED_TOKENS // length)


def _arrays(lengths: list[int], width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    qkv = np.random.default_rng(seed).standard_normal((sum(lengths), width)).astype(np.float32)
    return qkv, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def bias_table(kernel: dict, heads: int, max_len: int) -> np.ndarray | None:
    """The bias a kernel is served with, as far as its masking goes: a window's or a causal mask's
    table (``model/modernbert.window_bias``), else random (MPNet's learned relative bias)."""
    from dietserve.model.modernbert import window_bias

    if not kernel["relative_bias"]:
        return None
    if kernel["window"] is not None or kernel["causal"]:
        return window_bias(heads, max_len, kernel["window"], kernel["causal"])
    return np.random.default_rng(1).uniform(-1, 1, (heads, 2 * max_len - 1)).astype(np.float32)


def measure_tiles(job: dict) -> list[dict]:
    """Per tile of the job: ``{"latencies": [seconds per sequence at each length, the kernels'
    mean over the layers calling them]}`` or ``{"error": message}``."""
    import tvm

    from dietserve.host.cpu import configure_cpu_threads
    from dietserve.kernels.cpu_varlen.attention import query_parts_for, varlen_attention
    from dietserve.kernels.cpu_varlen.tile import VarlenTile
    from dietserve.kernels.tir.build import build

    heads, head_dim, max_len, kv_heads = job["heads"], job["head_dim"], job["max_len"], job.get("kv_heads")
    kernels = job.get("kernels") or [{"calls": 1, "relative_bias": False, "window": None, "causal": False}]
    width = (heads + 2 * (kv_heads or heads)) * head_dim
    target = tvm.target.Target({k: v for k, v in job["target"].items() if k != "host"})
    configure_cpu_threads(job.get("threads"))
    device, timing = tvm.cpu(0), TimingPolicy(**job["timing"])
    tensor = functools.partial(tvm.runtime.tensor, device=device)
    biases = [bias_table(kernel, heads, max_len) for kernel in kernels]
    check = [min(length, max_len) for length in CHECK_LENGTHS]
    qkv, starts = _arrays(check, width, seed=0)
    expected = [numpy_attention(qkv, starts, heads, head_dim, kv_heads, bias) for bias in biases]  # (per kernel)
    parts = query_parts_for(heads, job.get("threads"))
    precision = job.get("precision", "fp32")
    tolerance = BF16_CHECK_TOLERANCE if precision == "bf16" else CHECK_TOLERANCE
    results, modules = [], {}
    for index, raw in enumerate(job["tiles"]):
        try:
            tile, built = VarlenTile(**raw), []
            for kernel, bias, right in zip(kernels, biases, expected, strict=True):
                masking = {name: kernel[name] for name in ("relative_bias", "window", "causal")}
                func = varlen_attention(heads, head_dim, max_len, tile, precision=precision, kv_heads=kv_heads,
                                        query_parts=parts, **masking).with_attr("global_symbol", "main")
                module = build(tvm.IRModule({"main": func}), target).jit()
                out = tensor(np.full(right.shape, np.nan, np.float32))
                module["main"](tensor(qkv), tensor(starts), *([] if bias is None else [tensor(bias)]), out)
                error = np.abs(out.numpy() - right).max() / np.abs(right).max()
                if not error < tolerance:
                    raise ValueError(f"wrong result on lengths {check} ({masking}): {error:.3g} of the largest output")
                built.append(module)
            modules[index] = built
            results.append({"latencies": []})
        except Exception as err:  # noqa: BLE001 - a failing tile is a result, not a crash
            results.append({"error": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc(limit=6)})
    calls = [kernel["calls"] for kernel in kernels]
    for length in job["lengths"]:
        count = sequences_timed(length)
        qkv, starts = _arrays([length] * count, width, seed=length)
        out = tensor(np.empty((qkv.shape[0], heads * head_dim), np.float32))
        arguments = [[tensor(qkv), tensor(starts), *([] if b is None else [tensor(b)]), out] for b in biases]
        for index, built in modules.items():
            seconds = [timing.time(module, device, arguments[k], None, local=True) for k, module in enumerate(built)]
            results[index]["latencies"].append(float(np.dot(calls, seconds)) / sum(calls) / count)
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
