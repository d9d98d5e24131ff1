"""bert-base's layer norm and attention kernels called straight from a compiled artifact's
library, without the VM or the operator profile's hook (which inflates small parallel kernels).

    python tests/benchmarks/kernels_in_isolation.py ARTIFACT_DIR [--lengths 48,128,512] [--rounds 7]

For the layer norm, three ways, medians of ``--rounds`` rounds of 100 calls in us: right after
the FFN output kernel that feeds it, on that kernel's output and on another tensor (does its
producer's output cost it anything?), and back to back from cache. For attention (lengths of
128 and more), the scores with their fused softmax and the context product, back to back,
against each product at the FMA peak (``kernel_baselines.fma_peak_rate``). The PrimFunc names
and signatures are bert-base's (hidden 768, 12 heads, FFN 3072) as Relax fuses them. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tvm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_baselines  # noqa: E402

from dietserve.compile.target import TargetSpec, build_target  # noqa: E402
from dietserve.host.cpu import configure_cpu_threads  # noqa: E402
from dietserve.runtime.manifest import LIBRARY_FILE, Manifest  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, FFN = 768, 12, 64, 3072


def median_us(kernel, args: tuple, rounds: int, calls: int, before: tuple | None = None) -> float:
    """Median over rounds of the mean time of ``kernel(*args)`` in us; ``before`` (a kernel and
    its arguments, untimed) runs ahead of each call."""
    per_round = []
    for _ in range(rounds):
        total = 0
        for _ in range(calls):
            if before is not None:
                before[0](*before[1])
            start = time.perf_counter_ns()
            kernel(*args)
            total += time.perf_counter_ns() - start
        per_round.append(total / calls / 1e3)
    return statistics.median(per_round)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--lengths", default="48,128,512")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    configure_cpu_threads()
    library = tvm.runtime.load_module(str(args.artifact / LIBRARY_FILE)).imports[0]
    dense, norm = library["fused_matmul5_add4_add5"], library["layer_norm"]
    # the FFN output layer's weight as the artifact packs it: [HIDDEN / panel, FFN, panel]
    panel = Manifest.read(args.artifact).dispatch.get("fused_matmul5_add4_add5", {}).get("packed_panel", 0)
    weight_shape = (HIDDEN // panel, FFN, panel) if panel else (HIDDEN, FFN)
    scores, context = library["fused_matmul1_multiply1_add3_softmax"], library["matmul2"]
    peak = kernel_baselines.fma_peak_rate(  # GFLOP/s
        build_target(TargetSpec(kind="llvm")), repeats=3)
    device, rng = tvm.cpu(), np.random.default_rng(0)

    def tensor(*shape, fill=None):
        values = np.zeros(shape) if fill == 0 else rng.standard_normal(shape) * (fill or 1.0)
        return tvm.runtime.tensor(values.astype("float32"), device)

    print(f"# FMA peak {peak:.1f} GFLOP/s; us per call, medians of {args.rounds} rounds")
    for seq in (int(s) for s in args.lengths.split(",")):
        produced, other, out = tensor(seq, HIDDEN, fill=0), tensor(seq, HIDDEN), tensor(seq, HIDDEN, fill=0)
        feed = (dense, (tensor(seq, FFN), tensor(*weight_shape, fill=0.01), tensor(HIDDEN),
                        tensor(seq, HIDDEN), seq, 1, produced))
        gamma, beta = tensor(HIDDEN), tensor(HIDDEN)
        after_own = median_us(norm, (produced, gamma, beta, 1, seq, out), args.rounds, 100, feed)
        after_other = median_us(norm, (other, gamma, beta, 1, seq, out), args.rounds, 100, feed)
        hot = median_us(norm, (other, gamma, beta, 1, seq, out), args.rounds, 100)
        print(f"seq {seq:4d} layer_norm after its producer: on its output {after_own:7.1f}, on another tensor "
              f"{after_other:7.1f}; back to back {hot:7.1f}")
        if seq < 128:
            continue
        probs = tensor(1, HEADS, seq, seq, fill=0)
        calls = max(5, 4000 // seq)
        scores_us = median_us(scores, (tensor(1, HEADS, seq, HEAD_DIM), tensor(1, HEADS, HEAD_DIM, seq),
                                       tensor(1, 1, 1, seq, fill=0), probs), args.rounds, calls)
        values, ctx = tensor(1, HEADS, seq, HEAD_DIM), tensor(1, HEADS, seq, HEAD_DIM, fill=0)
        context_us = median_us(context, (probs, values, ctx), args.rounds, calls)
        at_peak = 2 * HEADS * seq * seq * HEAD_DIM / (peak * 1e9) * 1e6
        print(f"seq {seq:4d} attention: scores + softmax {scores_us:8.1f}, context {context_us:8.1f}; "
              f"each product at the FMA peak {at_peak:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
