"""Where the machine's two vCPUs sit, and what it does to the model: each sample times a cache
line handed between CPU 0 and CPU 1 (one-way, 200,000 round trips) and a 2-thread read of 256 MB
(a small C probe, built here with gcc), then an artifact at a few sequence lengths. On a small
cloud machine the samples can fall in two groups, as the host moves the vCPUs: both on one L3
(a fast hand-off) or on two (a slow hand-off, with a faster read: two paths to memory).

    python tests/benchmarks/vcpu_placement.py ARTIFACT_DIR [--minutes 15] [--lengths 1,16,31,128]
        [--operators 128]

Prints every sample, then per placement (hand-off below or above ``--far-ns``) the medians of
the hand-off, the read rate and the latency at each length. With ``--operators SEQ`` each sample
also profiles the PrimFuncs at that length (``operator_profile.profile_operators``, its hook's
overhead included, alike in both placements) and the operators are listed by how much slower
they run with the vCPUs apart. Last line:

    RESULT near_samples=N far_samples=F far_vs_near_seq<L>=R ...   (R > 1: slower on two L3s)

Not a test: it needs gcc and both placements to occur while it runs.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from operator_profile import profile_operators  # noqa: E402

from dietserve.runtime.artifact import load_artifact  # noqa: E402
from dietserve.runtime.engine import Engine  # noqa: E402

PROBE_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdatomic.h>
static _Atomic int flag __attribute__((aligned(64)));
enum { ROUNDS = 200000 };
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void pin(int cpu) {
  cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s); pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}
static void *pong(void *arg) {
  (void)arg; pin(1);
  for (int i = 0; i < ROUNDS; i++) {
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 1) {}
    atomic_store_explicit(&flag, 2 * i + 2, memory_order_release);
  }
  return 0;
}
#define N ((256u << 20) / 8)
static double *buf;
static double sums[2];
static void *reader(void *arg) {
  long id = (long)arg; pin((int)id); double s = 0; size_t half = N / 2; double *p = buf + id * half;
  for (int r = 0; r < 3; r++)
    for (size_t i = 0; i < half; i += 8) s += p[i] + p[i+1] + p[i+2] + p[i+3] + p[i+4] + p[i+5] + p[i+6] + p[i+7];
  sums[id] = s; return 0;
}
int main(void) {
  pin(0); pthread_t t; atomic_store(&flag, 0); pthread_create(&t, 0, pong, 0);
  double t0 = now();
  for (int i = 0; i < ROUNDS; i++) {
    atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {}
  }
  double handoff = (now() - t0) / ROUNDS / 2 * 1e9; pthread_join(t, 0);
  buf = aligned_alloc(4096, N * 8); memset(buf, 1, N * 8);
  pthread_t a, b; t0 = now();
  pthread_create(&a, 0, reader, (void *)0); pthread_create(&b, 0, reader, (void *)1);
  pthread_join(a, 0); pthread_join(b, 0);
  printf("handoff_ns %.0f read_gbs %.1f (%g)\n", handoff, 3.0 * N * 8 / (now() - t0) / 1e9, sums[0] + sums[1]);
  return 0;
}
"""


def build_probe(folder: Path) -> Path:
    source, binary = folder / "probe.c", folder / "probe"
    source.write_text(PROBE_C)
    subprocess.run(["gcc", "-O2", "-pthread", str(source), "-o", str(binary)], check=True)
    return binary


def print_operators(operators: dict, calls: dict, seq: int, top: int) -> None:
    """Each PrimFunc's median ms a run in both placements, the most slowed down first."""
    rows = [(statistics.median(operators["far"][s]) - statistics.median(operators["near"][s]), s,
             statistics.median(operators["near"][s]), statistics.median(operators["far"][s]))
            for s in operators["near"] if s in operators["far"]]
    near, far = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(f"# operators at seq {seq} (under the profile hook), ms a run: near {near:.2f}, far {far:.2f}, "
          f"far - near {far - near:+.2f}")
    for difference, symbol, near_ms, far_ms in sorted(rows, reverse=True)[:top]:
        print(f"  {symbol[:48]:48s} {calls[symbol]:3d} calls  near {near_ms:8.3f}  far {far_ms:8.3f}  "
              f"{difference:+7.3f} ms  x{far_ms / near_ms:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--lengths", default="1,16,31,128")
    parser.add_argument("--runs", type=int, default=5, help="model runs per length and sample (median)")
    parser.add_argument("--far-ns", type=float, default=100.0, help="hand-offs above this: the vCPUs on two L3s")
    parser.add_argument("--operators", type=int, default=None, metavar="SEQ",
                        help="also profile the PrimFuncs at this length in every sample")
    parser.add_argument("--top", type=int, default=15, help="operators listed with --operators")
    args = parser.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    engine = Engine(load_artifact(args.artifact))
    inputs = {length: np.full((1, length), 1000, np.int64) for length in lengths}
    for length in lengths:
        engine.run(inputs[length])

    def latency_ms(length: int) -> float:
        samples = []
        for _ in range(args.runs):
            start = time.perf_counter()
            engine.run(inputs[length])
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3

    groups: dict[str, list[list[float]]] = {"near": [], "far": []}  # placement -> samples
    operators: dict[str, dict[str, list[float]]] = {"near": {}, "far": {}}  # placement -> PrimFunc -> ms a run
    calls: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        probe = build_probe(Path(folder))
        end = time.time() + args.minutes * 60
        print("handoff_ns read_gbs " + " ".join(f"seq{length}_ms" for length in lengths), flush=True)
        while time.time() < end:
            output = subprocess.run([str(probe)], capture_output=True, text=True, check=True).stdout
            handoff, read = (float(v) for v in re.search(r"handoff_ns (\S+) read_gbs (\S+)", output).groups())
            row = [handoff, read, *(latency_ms(length) for length in lengths)]
            place = "near" if handoff <= args.far_ns else "far"
            groups[place].append(row)
            if args.operators is not None:
                for symbol, seconds, count in profile_operators(engine, 1, args.operators, repeats=3):
                    operators[place].setdefault(symbol, []).append(seconds * 1e3)
                    calls[symbol] = count
            print(" ".join(f"{v:.2f}" for v in row), flush=True)
    medians = {}
    for name, group in groups.items():
        if not group:
            print(f"# {name}: no samples")
            continue
        medians[name] = [statistics.median(r[i] for r in group) for i in range(len(lengths) + 2)]
        print(f"# {name}: {len(group)} samples, hand-off {medians[name][0]:.0f} ns, read {medians[name][1]:.1f} GB/s, "
              + ", ".join(f"seq {length} {medians[name][2 + i]:.2f} ms" for i, length in enumerate(lengths)))
    ratios = ""
    if len(medians) == 2:
        ratios = " " + " ".join(f"far_vs_near_seq{length}={medians['far'][2 + i] / medians['near'][2 + i]:.3f}"
                                for i, length in enumerate(lengths))
    if args.operators is not None and len(medians) == 2:
        print_operators(operators, calls, args.operators, args.top)
    print(f"RESULT near_samples={len(groups['near'])} far_samples={len(groups['far'])}{ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
