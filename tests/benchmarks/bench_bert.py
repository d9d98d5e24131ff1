"""Latency per sequence length of our compiled artifacts beside PyTorch eager, ONNX Runtime and
OpenVINO on the CPU, same thread count, measured one backend after another per point (the order
rotated every round), in ``--rounds`` rounds over the whole table (median of the rounds), in one
run; a point whose rounds were half or more busy for every backend alike (the machine, not a
backend) gets up to ``--extra-rounds`` more, and says so. Beside them, a floor: the encoder's
matrix products (dense layers and attention) at the machine's FMA peak, or its dense weights
read once at the DRAM rate, whichever is longer, both measured in every round (``WeightFloor``;
the read before and after each point's backends, the faster taken). No fp32 backend goes below
it: it grants every FLOP the peak rate, a perfect overlap of the weights' stream with the FMAs,
and nothing for the rest of the model.

    python tests/benchmarks/bench_bert.py [--models bert-base,default,mpnet-base,modernbert-base,DIR] [--batches 1,8]
    python tests/benchmarks/bench_bert.py --tuned [--trials 32]     # also the tuned artifact
    python tests/benchmarks/bench_bert.py --mixed [--mixed-batches 8,32]  # packed vs padded, real text

Beside the untuned artifact (the default rule) every run measures the cold start's (``cold``:
plans from the hardware model, ``--plans analytic``, nothing measured), both in the CPU's
default layout (packed), and the cold start in the padded layout (``padded``, ``--layout
padded``, the graph CUDA builds): here every row is full, so packing saves nothing and its own
costs show.

With ``--tuned`` each model is first tuned with ``python -m dietserve tune`` (a real tuner
process, records kept in the cache folder and reused by later runs) and its tuned artifact is
measured beside the untuned one. Prints a table per model and batch, the variants per operator,
the tuning time, a per-operator profile at one length, and a last line

    RESULT geomean_tuned_vs_untuned=X min_tuned_vs_untuned=Y geomean_vs_ort=Z geomean_vs_openvino=V
           geomean_vs_torch=W geomean_vs_best=B min_vs_best=M geomean_cold_vs_tuned=C
           min_cold_vs_tuned=D geomean_cold_vs_best=E geomean_packed_vs_padded=P min_packed_vs_padded=Q

(one line) where ratios above 1 mean ours is faster; "ours" is the tuned artifact with
``--tuned``, else the untuned one; "best" is the faster of ONNX Runtime and OpenVINO at each
point. Then ``PAIRED geomean_vs_best=.. min_vs_best=..``: each point's ratio taken within each
round (the faster of the two in that round over ours in it, seconds apart) and its median over
rounds, the table's ``paired`` column: on a host whose speed swings from one minute to the
next, the per-backend medians can come from different rounds.
Then ``FLOOR geomean_floor_vs_ours=.. geomean_floor_vs_best=..``
(1.0: at the floor) and what a backend at the floor at every point would be against the best:
more than any fp32 backend can reach on this machine.

``--mixed`` measures instead what indexing documents is: batches of 8 and 32 texts of real
prose (``bench_serve.real_passages``, the model's tokenizer, padded to the batch's longest as
users run the peers), the packed artifact (``--layout packed``: no padded work) beside the
padded one (both cold starts, ``--plans analytic``), ONNX Runtime and OpenVINO, rounds rotated.
Beside each batch, the same texts run one at a time on each of our layouts (what a lone request
costs). Last line

    RESULT mixed_packed_vs_padded=A min_mixed_packed_vs_padded=B mixed_packed_vs_best=C
           min_mixed_packed_vs_best=D token_cost_b8_vs_b1=E lone_packed_vs_padded=F

(geomeans over the batches; token_cost_b8_vs_b1: the packed artifact's seconds per token for a
batch of 8 over the same texts run one at a time; lone_packed_vs_padded: those single texts,
padded layout's time over packed's.) Beside each batch, ``%peak``: its matrix products' FLOPs at
this machine's FMA peak (the highest of each round's reading) over the packed artifact's time, for the batch and
for its texts one at a time: how much a batch could still save per token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bert_baselines  # noqa: E402
import kernel_baselines  # noqa: E402
from agreement import token_agreement  # noqa: E402
from operator_profile import profile_operators  # noqa: E402
from timing import busy_rounds, call_seconds, geomean, paired_ratio, rotated  # noqa: E402

from dietserve.compile.artifact import CompileRequest, compile_artifact  # noqa: E402
from dietserve.kernels.plan.kernel_plan import read_plans  # noqa: E402
from dietserve.model.config import SLIDING_ATTENTION  # noqa: E402
from dietserve.model.presets import default_model_folder, resolve_model  # noqa: E402
from dietserve.runtime.artifact import load_artifact  # noqa: E402
from dietserve.runtime.engine import Engine  # noqa: E402
from dietserve.runtime.manifest import LAYOUT_PACKED, LAYOUT_PADDED, PLANS_DIR, Manifest  # noqa: E402

DEFAULT_LENGTHS = [1, 2, 7, 13, 31, 64, 97, 128, 191, 256, 311, 384, 449, 512]  # primes included
POINT_BUDGET_S = 4.0  # per backend and point: fewer repeats for the slowest points (at least 3)
BUSY_FACTOR = 1.25  # a round in which every backend at a point ran this much slower than its best


def say(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


def median_latency(fn, args, repeats: int) -> float:
    time.sleep(kernel_baselines.SETTLE_S)  # lets the previous backend's spinning worker threads go idle
    start = time.perf_counter()
    fn(*args)  # warm up
    once = time.perf_counter() - start
    count = max(3, min(repeats, int(POINT_BUDGET_S / max(once, 1e-6))))
    return statistics.median(call_seconds(fn, args, count))


def tune(model: str, args: argparse.Namespace, max_batch: int, precision: str = "fp32") -> tuple[Path, float]:
    """Tune with the real command; returns (artifact, tuning seconds as recorded in the plans)."""
    suffix = "" if precision == "fp32" else f"-{precision}"
    out = args.cache_dir / "bench-tuned" / f"{model.replace('/', '_')}-t{args.trials}{suffix}"
    command = [sys.executable, "-m", "dietserve", "tune", "--model", model, "--trials", str(args.trials),
               "--max-batch", str(max_batch), "--db", str(out / "records.jsonl"), "--out", str(out),
               "--cache-dir", str(args.cache_dir), "--precision", precision]
    say(" ".join(command))
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    artifact = Path(done.stdout.strip().splitlines()[-1])
    seconds = sum(plan.provenance.get("tuning_seconds", 0.0) for plan in read_plans([artifact / PLANS_DIR]))
    return artifact, seconds


def variants_per_operator(artifact: Path) -> str:
    dispatch = Manifest.read(artifact).dispatch
    return ", ".join(f"{name}: {'/'.join(entry['variants'])}" for name, entry in dispatch.items())


class WeightFloor:
    """The time below which no fp32 backend goes on this machine for the encoder's matrix
    products alone (the dense layers and attention's two batched products): their FLOPs at the
    FMA peak (``kernel_baselines.fma_peak_rate``: multiply-adds in registers on every core), or
    the dense layers' weights read once from DRAM (a parallel read-only pass over as many bytes,
    on huge pages as the model's), whichever is longer. (Not numpy's sgemm rate: our dense
    kernels beat it, so it is no floor.) Both are measured in every round beside the backends:
    on a shared host the DRAM rate can move by half within one run, so a floor measured once, at
    another time, says little about a short sequence's run. Printed beside the backends so a ratio between
    them can be read against what is left to gain."""

    def __init__(self, checkpoint: Path, threads: int):
        from dietserve.model.checkpoint import Checkpoint
        from tuner.targets import resolve_target

        config = Checkpoint.open(checkpoint).config
        hidden, inner, width = config.hidden_size, config.intermediate_size, config.attention_width
        # (the checkpoint's own key and value widths, Qwen3's shared by groups of query heads; the
        # rotary families' gated activations: three intermediate-wide products, BERT's two)
        shared = (config.num_key_value_heads or config.num_attention_heads) * config.head_dim
        attention = hidden * (2 * width + 2 * shared)
        self.params = config.num_hidden_layers * (attention + (3 if config.rotary else 2) * hidden * inner)
        self.layers, self.width, self.causal = config.num_hidden_layers, width, config.causal
        # keys a query attends to, by layer: a sliding window's at most (ModernBERT's), else all
        self.windows = [2 * config.sliding_window + 1 if kind == SLIDING_ATTENTION else None
                        for kind in config.layer_types] or [None] * config.num_hidden_layers
        self.target = resolve_target("llvm", cores=threads).target
        self.read_weights = kernel_baselines.read_pass(self.target, 4 * self.params)
        self.fma_peak: list[float] = []  # GFLOP/s, one per round
        self.dram: list[float] = []  # GB/s, one per point and round

    def start_round(self) -> None:
        self.fma_peak.append(kernel_baselines.fma_peak_rate(self.target, repeats=3))

    def seconds(self, batch: int, seq: int, repeats: int) -> float:
        """This round's floor for ``batch`` sequences of ``seq`` tokens, the weights' read pass
        timed now."""
        read = median_latency(self.read_weights, (), repeats)
        self.dram.append(4 * self.params / read / 1e9)
        flops = batch * self.flops(seq)
        return max(flops / (self.fma_peak[-1] * 1e9), read)

    def flops(self, seq: int) -> int:
        """One sequence's dense layers, and attention's scores and context products: 2 x 2 * seq
        * keys * width per layer, keys within its window (a decoder's: those up to the query, on
        average (seq + 1) / 2)."""
        reach = (seq + 1) / 2 if self.causal else seq
        keys = sum(reach if window is None else min(seq, window) for window in self.windows)
        return int(2 * self.params * seq + 4 * seq * keys * self.width)

    def summary(self) -> str:
        return (f"{self.params / 1e6:.1f} M dense weights; FMA peak {min(self.fma_peak):.1f}-{max(self.fma_peak):.1f}"
                f" GFLOP/s"
                f" over the rounds, DRAM read {min(self.dram):.1f}-{max(self.dram):.1f} GB/s"
                f" (median {statistics.median(self.dram):.1f}) over the points and rounds")


def peers(model: str, args: argparse.Namespace, with_torch: bool) -> dict:
    """The baselines on the model's checkpoint, same thread count: ONNX Runtime and OpenVINO on one
    ONNX export, and PyTorch eager where asked."""
    import torch

    torch.set_num_threads(args.threads)
    reference = reference_model(model, args)
    with tempfile.TemporaryDirectory() as scratch:
        onnx_path = Path(scratch) / "bert.onnx"
        bert_baselines.export_onnx(reference, onnx_path)
        runs = {"torch": bert_baselines.torch_eager(reference)} if with_torch else {}
        return {**runs, "ort": bert_baselines.onnx_runtime(onnx_path, args.threads),
                "openvino": bert_baselines.openvino(onnx_path, args.threads)}


def bench_model(model: str, args: argparse.Namespace, ratios: dict[str, list[float]]) -> None:

    max_batch = max(args.batches)
    untuned = Engine(load_artifact(compile_artifact(CompileRequest(model=model, max_batch=max_batch),
                                                    args.cache_dir, progress=say)), threads=args.threads)
    cold = Engine(load_artifact(compile_artifact(CompileRequest(model=model, max_batch=max_batch, analytic=True),
                                                 args.cache_dir, progress=say)), threads=args.threads)
    padded = Engine(load_artifact(compile_artifact(CompileRequest(model=model, max_batch=max_batch, analytic=True,
                                                                  layout=LAYOUT_PADDED), args.cache_dir, progress=say)),
                    threads=args.threads)
    engines = {"untuned": untuned, "cold": cold, "padded": padded}
    if args.tuned:
        artifact, seconds = tune(model, args, max_batch)
        engines["tuned"] = Engine(load_artifact(artifact), threads=args.threads)
        print(f"# {model}: tuning {seconds:.0f} s ({args.trials} trials per operator); variants per operator: "
              f"{variants_per_operator(artifact)}")
    backends = {**{name: engine.run for name, engine in engines.items()}, **peers(model, args, with_torch=True)}
    ours = "tuned" if args.tuned else "untuned"
    rng = np.random.default_rng(0)
    points = {}
    for batch in args.batches:
        for seq in args.lengths:
            ids = rng.integers(1000, untuned.vocab_size, (batch, seq)).astype(np.int64)
            points[batch, seq] = (ids, np.ones_like(ids), np.zeros_like(ids))
    # Rounds over the whole table: a shared host has slow spells lasting seconds, which would
    # otherwise decide a point for whichever backend ran in one.
    floor = WeightFloor(resolve_model(model, args.cache_dir), args.threads)
    samples = {point: {name: [] for name in backends} for point in points}
    floors = {point: [] for point in points}

    def measure(point) -> None:
        # The floor's read pass before and after the point's backends, the faster taken: the DRAM
        # rate can change within the seconds a point takes, and a floor timed after it changed
        # can read slower than ours: no longer a floor.
        before = floor.seconds(*point, args.repeats)
        for name, fn in rotated(backends.items(), len(floors[point])):
            samples[point][name].append(median_latency(fn, points[point], args.repeats))
        floors[point].append(min(before, floor.seconds(*point, args.repeats)))

    for round_index in range(args.rounds):
        say(f"{model}: round {round_index + 1} of {args.rounds} over {len(points)} points x {len(backends)} backends")
        floor.start_round()
        for point in points:
            measure(point)
    # A busy spell of the machine that covers half a point's rounds moves its median for every
    # backend alike (one run read seq 13 at twice its usual time for all five): such a point gets
    # more rounds, all backends again, until its busy rounds are a minority (or the extra rounds
    # run out); the medians are then over every round.
    for point in points:
        busy, extra = busy_rounds(samples[point], BUSY_FACTOR), 0
        while 2 * len(busy) >= len(floors[point]) and extra < args.extra_rounds:
            floor.start_round()
            measure(point)
            busy, extra = busy_rounds(samples[point], BUSY_FACTOR), extra + 1
        if extra:
            print(f"# batch {point[0]} seq {point[1]}: {extra} extra round(s) after busy ones (every backend >= "
                  f"{BUSY_FACTOR}x its fastest round); busy now: {[r + 1 for r in busy]} of {len(floors[point])}")
    say(f"floor: {floor.summary()}")
    for batch in args.batches:
        print(f"# model={model} batch={batch} threads={args.threads} (median ms over {args.rounds} rounds); floor: "
              f"the encoder's matrix products at the FMA peak or its dense weights read once from DRAM, both"
              f" measured in each round ({floor.summary()}); best: the faster of ORT and OpenVINO")
        print(f"{'seq':>5} " + " ".join(f"{name:>9}" for name in backends)
              + f" {'floor':>8} {'tun/unt':>8} {'vs_ort':>7} {'vs_ov':>7} {'vs_best':>7} {'vs_torch':>8}"
              + f" {'floor/ours':>10} {'floor/best':>10} {'paired':>7}")
        for seq in args.lengths:
            times = {name: statistics.median(values) for name, values in samples[batch, seq].items()}
            best = min(times["ort"], times["openvino"])
            point = {"tuned_vs_untuned": times["untuned"] / times[ours], "vs_ort": times["ort"] / times[ours],
                     "vs_openvino": times["openvino"] / times[ours], "vs_best": best / times[ours],
                     "vs_torch": times["torch"] / times[ours]}
            point["cold_vs_best"] = best / times["cold"]
            point["packed_vs_padded"] = times["padded"] / times["cold"]
            if args.tuned:
                point["cold_vs_tuned"] = times["tuned"] / times["cold"]
            for key, value in point.items():
                ratios[key].append(value)
            paired = paired_ratio(samples[batch, seq], ours, ("ort", "openvino"))
            ratios["paired_vs_best"].append(paired)
            lower = statistics.median(floors[batch, seq])
            ratios["floor_vs_ours"].append(lower / times[ours])
            ratios["floor_vs_best"].append(lower / best)
            print(f"{seq:>5} " + " ".join(f"{t * 1e3:>9.2f}" for t in times.values())
                  + f" {lower * 1e3:>8.2f} {point['tuned_vs_untuned']:>8.2f} {point['vs_ort']:>7.2f}"
                  + f" {point['vs_openvino']:>7.2f} {point['vs_best']:>7.2f} {point['vs_torch']:>8.2f}"
                  + f" {lower / times[ours]:>10.2f} {lower / best:>10.2f} {paired:>7.2f}", flush=True)
    profile_at = args.profile_seq
    for name, engine in engines.items():
        rows = profile_operators(engine, 1, profile_at)
        total = sum(seconds for _, seconds, _ in rows)
        print(f"# {model} {name}: where the time goes at batch 1, seq {profile_at} ({total * 1e3:.2f} ms in kernels)")
        for symbol, seconds, calls in rows[:10]:
            print(f"#   {symbol:<40} {seconds * 1e3:8.3f} ms {100 * seconds / total:5.1f}%  x{calls}")


def bench_mixed(model: str, args: argparse.Namespace, ratios: dict[str, list[float]]) -> None:
    """Batches of real texts: packed vs padded vs ONNX Runtime and OpenVINO (see ``--mixed``)."""
    from bench_serve import real_passages

    from dietserve.model.tokenizer import TextTokenizer

    sizes = args.mixed_batches
    artifacts = {layout: compile_artifact(CompileRequest(model=model, max_batch=max(sizes), analytic=True,
                                                         layout=layout), args.cache_dir, progress=say)
                 for layout in (LAYOUT_PACKED, LAYOUT_PADDED)}
    engines = {layout: Engine(load_artifact(path), threads=args.threads) for layout, path in artifacts.items()}
    backends = {**{layout: engine.run for layout, engine in engines.items()}, **peers(model, args, with_torch=False)}
    tokenizer = TextTokenizer.from_folder(artifacts["padded"], engines["padded"].max_seq_len)
    passages = iter(real_passages(sum(sizes) * args.mixed_sets, seed=0))
    batches = []  # (size, encoded): each batch its own texts
    for size in sizes:
        for _ in range(args.mixed_sets):
            encoded = tokenizer.encode([next(passages) for _ in range(size)])
            batches.append((size, (encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)))

    def one_at_a_time(engine):
        def run(ids, mask, types):
            for row in range(ids.shape[0]):
                length = int(mask[row].sum())
                engine.run(ids[row:row + 1, :length], mask[row:row + 1, :length], types[row:row + 1, :length])
        return run

    singles = {f"{layout} x1": one_at_a_time(engine) for layout, engine in engines.items()}
    samples = [{name: [] for name in (*backends, *singles)} for _ in batches]
    floor = WeightFloor(resolve_model(model, args.cache_dir), args.threads)  # (its FMA peak, each round)
    for round_index in range(args.rounds):
        say(f"{model} mixed: round {round_index + 1} of {args.rounds} over {len(batches)} batches")
        floor.start_round()
        for index, (_size, inputs) in enumerate(batches):
            for name, fn in rotated([*backends.items(), *singles.items()], round_index):
                samples[index][name].append(median_latency(fn, inputs, args.repeats))
    print(f"# model={model} threads={args.threads} mixed batches of real text (median ms over {args.rounds} rounds); "
          f"x1: the batch's texts one at a time")
    names = [*backends, *singles]
    print(f"{'texts':>5} {'tokens':>6} {'padded':>6} " + " ".join(f"{name:>10}" for name in names)
          + f" {'pk/pad':>7} {'pk/best':>7} {'tok b/1':>7} {'%peak':>6} {'%pk x1':>6}")
    peak = max(floor.fma_peak) * 1e9  # a ceiling: a round's reading on a busy host only comes out lower
    for (size, (ids, mask, _)), point in zip(batches, samples, strict=True):
        times = {name: statistics.median(values) for name, values in point.items()}
        best = min(times["ort"], times["openvino"])
        vs_padded, vs_best = times["padded"] / times[LAYOUT_PACKED], best / times[LAYOUT_PACKED]
        token_cost = times[LAYOUT_PACKED] / times[f"{LAYOUT_PACKED} x1"]  # the same tokens either way
        ratios["mixed_packed_vs_padded"].append(vs_padded)
        ratios["mixed_packed_vs_best"].append(vs_best)
        ratios["lone_packed_vs_padded"].append(times["padded x1"] / times[f"{LAYOUT_PACKED} x1"])
        if size == 8:
            ratios["token_cost_b8_vs_b1"].append(token_cost)
        # the matrix products' FLOPs (dense layers, attention's two per sequence) at the FMA peak
        lengths = mask.sum(axis=1).astype(np.int64)
        flops = sum(floor.flops(int(length)) for length in lengths)
        at_peak = flops / peak
        print(f"{size:>5} {int(mask.sum()):>6} {ids.size:>6} " + " ".join(f"{times[n] * 1e3:>10.2f}" for n in names)
              + f" {vs_padded:>7.2f} {vs_best:>7.2f} {token_cost:>7.2f} {100 * at_peak / times[LAYOUT_PACKED]:>6.1f}"
              + f" {100 * at_peak / times[f'{LAYOUT_PACKED} x1']:>6.1f}", flush=True)
    print(f"# %peak: the matrix products' FLOPs at the FMA peak (the highest of the rounds' readings) over the packed "
          f"batch's time (x1: the texts one at a time); {floor.params / 1e6:.1f} M dense weights, FMA peak "
          f"{min(floor.fma_peak):.1f}-{max(floor.fma_peak):.1f} GFLOP/s over the rounds")


def bench_precision(model: str, args: argparse.Namespace, ratios: dict[str, list[float]]) -> None:
    """``--precision bf16``: our bf16 build beside our fp32 build, OpenVINO at its default precision,
    PyTorch under bf16 autocast and ONNX Runtime (fp32), with each point's accuracy against
    transformers in fp32 (the smallest per-token cosine, ours and OpenVINO's)."""
    import torch

    max_batch = max(args.batches)
    artifacts = {}
    for precision in ("fp32", "bf16"):
        if args.tuned:
            artifacts[precision], seconds = tune(model, args, max_batch, precision)
            print(f"# {model} {precision}: tuning {seconds:.0f} s ({args.trials} trials per operator)")
        else:
            artifacts[precision] = compile_artifact(CompileRequest(model=model, max_batch=max_batch, analytic=True,
                                                                   precision=precision), args.cache_dir, progress=say)
    engines = {f"ours {p}": Engine(load_artifact(path), threads=args.threads) for p, path in artifacts.items()}
    torch.set_num_threads(args.threads)
    reference = reference_model(model, args)
    scratch = tempfile.TemporaryDirectory()
    onnx_path = Path(scratch.name) / "bert.onnx"
    bert_baselines.export_onnx(reference, onnx_path)
    openvino, chosen = bert_baselines.openvino_default(onnx_path, args.threads)
    backends = {**{name: engine.run for name, engine in engines.items()}, "openvino": openvino,
                "torch bf16": bert_baselines.torch_bf16(reference),
                "ort": bert_baselines.onnx_runtime(onnx_path, args.threads)}
    rng = np.random.default_rng(0)
    points = {}
    for batch in args.batches:
        for seq in args.lengths:
            ids = rng.integers(1000, engines["ours bf16"].vocab_size, (batch, seq)).astype(np.int64)
            points[batch, seq] = (ids, np.ones_like(ids), np.zeros_like(ids))
    accuracy = {point: {name: _token_cosines(as_array(backends[name](*inputs)), reference, inputs)
                        for name in ("ours bf16", "openvino")} for point, inputs in points.items()}
    from tuner.targets import resolve_target

    where = resolve_target("llvm", cores=args.threads)
    target, tiles = where.target, where.hardware.matrix_tiles  # (tiles: AMX kernels in the plans too)
    peaks = {"fp32": [], "bf16": [], **({"amx": []} if tiles else {})}
    samples = {point: {name: [] for name in backends} for point in points}
    for round_index in range(args.rounds):
        say(f"{model} bf16: round {round_index + 1} of {args.rounds} over {len(points)} points")
        peaks["fp32"].append(kernel_baselines.fma_peak_rate(target, repeats=3))
        peaks["bf16"].append(kernel_baselines.bf16_peak_rate(target, repeats=3))
        if tiles:
            peaks["amx"].append(kernel_baselines.amx_peak_rate(target, repeats=3))
        for point, inputs in points.items():
            for name, fn in rotated(backends.items(), round_index):
                samples[point][name].append(median_latency(fn, inputs, args.repeats))
    span = {p: f"{min(v):.0f}-{max(v):.0f}" for p, v in peaks.items()}
    for batch in args.batches:
        print(f"# model={model} batch={batch} threads={args.threads} (median ms over {args.rounds} rounds); OpenVINO "
              f"at its default precision: {chosen}; peaks over the rounds: fp32 FMA {span['fp32']} GFLOP/s, bf16 "
              f"(vdpbf16ps) {span['bf16']} GFLOP/s" + (f", AMX (tdpbf16ps) {span['amx']} GFLOP/s" if tiles else "")
              + "; cos: the smallest per-token cosine to transformers fp32")
        print(f"{'seq':>5} " + " ".join(f"{name:>10}" for name in backends)
              + f" {'bf16/fp32':>9} {'vs_ov':>6} {'vs_tbf16':>8} {'vs_ort':>6} {'cos ours':>9} {'cos ov':>9}")
        for seq in args.lengths:
            times = {name: statistics.median(values) for name, values in samples[batch, seq].items()}
            ours = times["ours bf16"]
            point = {"bf16_vs_fp32": times["ours fp32"] / ours, "vs_openvino_bf16": times["openvino"] / ours,
                     "vs_torch_bf16": times["torch bf16"] / ours, "vs_ort": times["ort"] / ours}
            for key, value in point.items():
                ratios[key].append(value)
            if seq >= 128:
                ratios["bf16_vs_fp32_seq128plus"].append(point["bf16_vs_fp32"])
            cosines = accuracy[batch, seq]
            print(f"{seq:>5} " + " ".join(f"{t * 1e3:>10.2f}" for t in times.values())
                  + f" {point['bf16_vs_fp32']:>9.2f} {point['vs_openvino_bf16']:>6.2f} {point['vs_torch_bf16']:>8.2f}"
                  + f" {point['vs_ort']:>6.2f} {cosines['ours bf16']:>9.6f} {cosines['openvino']:>9.6f}", flush=True)
    scratch.cleanup()


def as_array(output) -> np.ndarray:
    """A backend's last hidden state as numpy (OpenVINO: its first output; torch: a tensor)."""
    if hasattr(output, "last_hidden_state"):
        output = output.last_hidden_state
    if isinstance(output, dict) or hasattr(output, "values"):
        output = list(output.values())[0]
    return output.float().numpy() if hasattr(output, "float") else np.asarray(output)


def _token_cosines(hidden: np.ndarray, reference, inputs) -> float:
    import torch

    with torch.no_grad():
        names = bert_baselines.input_names(reference)
        expected = reference(**bert_baselines.torch_inputs(names, *inputs)).last_hidden_state.numpy()
    return token_agreement(hidden, expected)[0]


def reference_model(model: str, args: argparse.Namespace):
    """transformers' own model of the checkpoint (BERT or a relative), eager attention."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(resolve_model(model, args.cache_dir)), attn_implementation="eager").eval()


# ``--models`` names of random-weight models of real checkpoints' shapes: transformers' config and
# model classes, the config's arguments (each family's defaults are its base model's shapes), the model's
RANDOM_FAMILIES = {
    "mpnet-base": ("MPNetConfig", "MPNetModel", {"max_position_embeddings": 514, "vocab_size": 30527},
                   {"add_pooling_layer": False}),  # all-mpnet-base-v2
    "modernbert-base": ("ModernBertConfig", "ModernBertModel", {"pad_token_id": 0}, {}),  # gte-modernbert-base
    # Qwen3-Embedding-0.6B's layers (its vocabulary cut to the default tokenizer's: a lookup either way)
    "qwen3-embedding-0.6b": ("Qwen3Config", "Qwen3Model", {
        "vocab_size": 30522, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, "pad_token_id": 0}, {}),
    # EmbeddingGemma-300M's layers (its vocabulary cut alike): a full layer in six, the others within
    # 256 tokens, 3 query heads of 256 over one key and value head
    "embeddinggemma-300m": ("Gemma3TextConfig", "Gemma3TextModel", {
        "vocab_size": 30522, "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 24,
        "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "max_position_embeddings": 2048, "use_bidirectional_attention": True,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        "pad_token_id": 0}, {}),
    # nomic-embed-text-v1.5's: BERT-base's sizes, rotary positions, gated SiLU, no linear biases
    "nomic-embed-text-v1.5": ("NomicBertConfig", "NomicBertModel", {"max_position_embeddings": 8192}, {}),
    # gte-multilingual-base's (its vocabulary cut to the default tokenizer's): rotary, gated GELU, biases
    "gte-multilingual-base": ("GteConfig", "GteModel", {"vocab_size": 30522, "pad_token_id": 0}, {}),
}


def random_family_model(name: str, cache_dir: Path) -> str:
    """``--models mpnet-base`` (all-mpnet-base-v2's shapes: 12 layers of 768, relative position
    buckets), ``modernbert-base`` (22 layers of 768, rotary positions, gated GELU, sliding
    windows, 8,192 positions) or ``qwen3-embedding-0.6b`` (28 causal layers of 1024, 16 query
    heads of 128 over 8 key and value heads, gated SiLU, 32,768 positions) or
    ``embeddinggemma-300m`` (24 bidirectional layers of 768, five in six within a window, gated
    tanh GELU, 2,048 positions), ``nomic-embed-text-v1.5`` (12 post-norm layers of 768, rotary
    positions, gated SiLU, 8,192 positions) or ``gte-multilingual-base`` (the same with a gated
    GELU and biases): random weights from
    transformers' own initialisation (seed 0), written once under the cache folder; the default
    model's tokenizer (``--mixed`` reads text)."""
    import shutil

    import torch
    import transformers

    config_class, model_class, arguments, model_arguments = RANDOM_FAMILIES[name]
    folder = cache_dir / "models" / f"{name}-random-seed0"
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**arguments)
        getattr(transformers, model_class)(config, **model_arguments).eval().save_pretrained(str(staging))
        for file in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(default_model_folder() / file, staging / file)
        os.replace(staging, folder)  # whole or not at all
    return str(folder)


def over_models(bench, args: argparse.Namespace, keys) -> dict[str, list[float]]:
    """``bench(model, args, ratios)`` for each of ``--models``, collecting ``keys``' ratios."""
    ratios: dict[str, list[float]] = {key: [] for key in keys}
    for model in args.models.split(","):
        bench(model, args, ratios)
    return ratios


def result_line(ratios: dict[str, list[float]], fields) -> str:
    """``RESULT`` with each (statistic, key) of ``fields``: ``geomean`` or ``min`` of the key's
    ratios, named ``statistic_key`` (a bare key for "": the geomean)."""
    def value(statistic: str, values: list[float]) -> float:
        return min(values, default=float("nan")) if statistic == "min" else geomean(values)

    return "RESULT " + " ".join(f"{statistic + '_' if statistic else ''}{key}={value(statistic, ratios[key]):.3f}"
                                for statistic, key in fields)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert-base,default",
                        help=f"comma-separated: bert-base, default, a random-weight family "
                             f"({', '.join(RANDOM_FAMILIES)}) or DIR")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per point and round at most (at least 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over the whole table (median of the rounds' medians reported; default 3)")
    parser.add_argument("--extra-rounds", type=int, default=4,
                        help="rounds added at most to a point whose rounds were half or more busy for every "
                             "backend alike (default 4; 0: none)")
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--tuned", action="store_true", help="tune each model and measure the tuned artifact too")
    parser.add_argument("--trials", type=int, default=32, help="with --tuned: measurements per operator")
    parser.add_argument("--profile-seq", type=int, default=128, help="sequence length of the per-operator profile")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dietserve")
    parser.add_argument("--mixed", action="store_true",
                        help="batches of real texts: the packed artifact vs the padded one and the peers")
    parser.add_argument("--mixed-batches", default="8,32", help="with --mixed: texts per batch (default 8,32)")
    parser.add_argument("--mixed-sets", type=int, default=3, help="with --mixed: batches of each size (default 3)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: our bf16 build beside our fp32 one, OpenVINO at its default precision, "
                             "PyTorch bf16 autocast and ONNX Runtime (see bench_precision)")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.models = ",".join(random_family_model(model, args.cache_dir) if model in RANDOM_FAMILIES else model
                           for model in args.models.split(","))
    if args.precision == "bf16":
        found = over_models(bench_precision, args, ("vs_openvino_bf16", "bf16_vs_fp32", "bf16_vs_fp32_seq128plus",
                                                    "vs_torch_bf16", "vs_ort"))
        print(result_line(found, [("geomean", "vs_openvino_bf16"), ("min", "vs_openvino_bf16"),
                                  ("geomean", "bf16_vs_fp32"), ("geomean", "bf16_vs_fp32_seq128plus"),
                                  ("min", "bf16_vs_fp32_seq128plus"), ("geomean", "vs_torch_bf16"),
                                  ("geomean", "vs_ort")]))
        return 0
    args.mixed_batches = [int(b) for b in args.mixed_batches.split(",")]
    if args.mixed:
        mixed = over_models(bench_mixed, args, ("mixed_packed_vs_padded", "mixed_packed_vs_best",
                                                "token_cost_b8_vs_b1", "lone_packed_vs_padded"))
        # (its geomeans named bare, as the lines of its earlier runs name them)
        print(result_line(mixed, [("", "mixed_packed_vs_padded"), ("min", "mixed_packed_vs_padded"),
                                  ("", "mixed_packed_vs_best"), ("min", "mixed_packed_vs_best"),
                                  ("", "token_cost_b8_vs_b1"), ("", "lone_packed_vs_padded")]))
        return 0
    ratios: dict[str, list[float]] = {key: [] for key in (
        "tuned_vs_untuned", "vs_ort", "vs_openvino", "vs_best", "vs_torch", "floor_vs_ours", "floor_vs_best",
        "paired_vs_best", "cold_vs_best", "cold_vs_tuned", "packed_vs_padded")}
    for model in args.models.split(","):
        bench_model(model, args, ratios)
    print(f"RESULT geomean_tuned_vs_untuned={geomean(ratios['tuned_vs_untuned']):.3f} "
          f"min_tuned_vs_untuned={min(ratios['tuned_vs_untuned']):.3f} "
          f"geomean_vs_ort={geomean(ratios['vs_ort']):.3f} geomean_vs_openvino={geomean(ratios['vs_openvino']):.3f} "
          f"geomean_vs_torch={geomean(ratios['vs_torch']):.3f} geomean_vs_best={geomean(ratios['vs_best']):.3f} "
          f"min_vs_best={min(ratios['vs_best']):.3f} geomean_cold_vs_tuned={geomean(ratios['cold_vs_tuned']):.3f} "
          f"min_cold_vs_tuned={min(ratios['cold_vs_tuned'], default=float('nan')):.3f} "
          f"geomean_cold_vs_best={geomean(ratios['cold_vs_best']):.3f} "
          f"geomean_packed_vs_padded={geomean(ratios['packed_vs_padded']):.3f} "
          f"min_packed_vs_padded={min(ratios['packed_vs_padded']):.3f}")
    print(f"PAIRED geomean_vs_best={geomean(ratios['paired_vs_best']):.3f} "
          f"min_vs_best={min(ratios['paired_vs_best']):.3f} (each point: the median over rounds of that round's "
          f"best/ours)")
    print(f"FLOOR geomean_floor_vs_ours={geomean(ratios['floor_vs_ours']):.3f} "
          f"geomean_floor_vs_best={geomean(ratios['floor_vs_best']):.3f} (1.0: at the matrix products' floor); "
          f"a backend at the floor at every point would be {1 / geomean(ratios['floor_vs_best']):.3f}x the best")
    return 0


if __name__ == "__main__":
    sys.exit(main())
