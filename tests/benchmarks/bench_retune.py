"""Latency over time across a traffic drift, the background re-tune and the hot swap, against a
real server serving a version store (all-MiniLM-L6-v2 on this CPU).

    python tests/benchmarks/bench_retune.py [--trials 16] [--plot retune.png] [--retune-cpus 1] [--retune-nice N]

1. Kernels are tuned for short sequences (1..16 tokens) and published as version 1, with that mix
   as the mix they were tuned for.
2. A server serves the store with re-tuning on. One client sends long requests (256..512 tokens,
   real token ids) back to back, recording every latency and checking every answer against the
   untuned engine run directly.
3. Phases from the server's log: idle (before the job starts), re-tuning (the job runs beside
   serving, niced, on --retune-cpus), checking (the published version loaded, its answers
   compared and its speed timed against the served one's, between requests), swapped (after it
   is swapped in).
   A probe request of 384 tokens is timed before the job starts and after the swap.

Prints a table of p50/p99 per phase, draws latency over time with the phases shaded
(``--plot``), and ends with

    RESULT drift_gain=X p99_during_retune_vs_idle=Y p99_during_check_vs_idle=C swap_errors=Z

(drift_gain: the probe's latency before / after; goals: swap_errors = 0, p99 during the re-tune
at most half again the idle p99, a measurable gain).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.compile.artifact import CompileRequest, compile_artifact  # noqa: E402
from dietserve.runtime.artifact import load_artifact  # noqa: E402
from dietserve.runtime.engine import Engine  # noqa: E402
from dietserve.runtime.traffic import Traffic  # noqa: E402
from dietserve.runtime.versions import VersionStore  # noqa: E402
from tests.integration.server_process import REPO_ROOT, ServerProcess  # noqa: E402

MODEL = "bench"
SHORT = tuple(range(1, 17))
PROBE = 384


def infer(client, ids: np.ndarray) -> np.ndarray:
    tensor = triton.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    return client.infer(MODEL, [tensor], client_timeout=120,
                        outputs=[triton.InferRequestedOutput("sentence_embedding")]).as_numpy("sentence_embedding")


def probe(url: str, repeats: int = 9) -> float:
    ids = np.full((1, PROBE), 2000, np.int64)
    with triton.InferenceServerClient(url) as client:
        infer(client, ids)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            infer(client, ids)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


SWAPPED = "and swapped in ("  # swap.py's line for a swap ("not swapped in:" is a refusal)
LOADING = ": loading from "  # swap.py's line as it starts on a version


def phase_times(server: ServerProcess) -> tuple[float | None, float | None, float | None]:
    """Wall-clock times (time.time()) the re-tuning job started, the swapped-in version's check
    started and the swap happened, from the server's log lines as this process saw them."""
    started, swapped = server.seen.get("re-tuning (", [None])[0], server.seen.get(SWAPPED, [None])[0]
    checking = max((t for t in server.seen.get(LOADING, []) if swapped is None or t <= swapped), default=None)
    return started, checking, swapped


class TimedServer(ServerProcess):
    """Records when each watched log line appeared."""

    WATCH = ("re-tuning (", LOADING, SWAPPED)

    def _read_log(self) -> None:
        self.seen = {}
        for line in self.process.stderr:
            for marker in self.WATCH:
                if marker in line:
                    self.seen.setdefault(marker, []).append(time.time())
            self.lines.append(line.rstrip())
            self._events.put(line)
        self._events.put("")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dietserve")
    parser.add_argument("--trials", type=int, default=16, help="measurements per operator, both tunings")
    parser.add_argument("--retune-cpus", default="1", help="CPUs the re-tuning job may use")
    parser.add_argument("--retune-nice", type=int, default=None,
                        help="the job's niceness (default: serve's own default, 10)")
    parser.add_argument("--after-swap-seconds", type=float, default=20.0)
    parser.add_argument("--plot", type=Path, default=Path("retune.png"))
    args = parser.parse_args()

    build = ["--model", "default", "--max-batch", "8", "--cache-dir", str(args.cache_dir)]
    reference = Engine(load_artifact(compile_artifact(CompileRequest(model="default", max_batch=8), args.cache_dir)))
    with tempfile.TemporaryDirectory(prefix="bench-retune-") as scratch:
        work = Path(scratch)
        short = Traffic(half_life_seconds=3600.0, as_of=0.0)
        for length in SHORT:
            short.record(1, length, now=0.0)
        short.save(work / "short.json")
        print(f"tuning for short sequences ({args.trials} trials per operator) ...", flush=True)
        tuned = subprocess.run([sys.executable, "-m", "dietserve", "tune", *build, "--trials", str(args.trials),
                                "--lengths", str(work / "short.json"), "--db", str(work / "records.jsonl"),
                                "--out", str(work / "short")], cwd=REPO_ROOT, capture_output=True, text=True)
        if tuned.returncode != 0:
            raise SystemExit(tuned.stderr[-3000:])
        VersionStore(work / "store").publish(Path(tuned.stdout.strip().splitlines()[-1]),
                                             tuned_for=work / "short.json", plans=work / "short" / "plans")
        server = TimedServer(None, "--artifact-store", str(work / "store"), "--no-batching", "--watch-seconds", "1",
                             "--traffic-file", str(work / "traffic.json"), "--traffic-save-seconds", "1",
                             "--retune", "--retune-min-rows", "100", "--retune-min-interval", "0",
                             "--retune-check-seconds", "2", "--retune-trials", str(args.trials),
                             "--retune-cpus", args.retune_cpus, "--retune-db", str(work / "records.jsonl"),
                             *([] if args.retune_nice is None else ["--retune-nice", str(args.retune_nice)]),
                             *build, model_name=MODEL)
        rng = np.random.default_rng(3)
        cases = [rng.integers(1000, 5000, size=(1, int(n))) for n in rng.integers(256, 513, size=8)]
        expected = [reference.run(ids).sentence_embedding for ids in cases]
        samples: list[tuple[float, float]] = []  # (wall time, seconds)
        errors: list[str] = []
        stop = threading.Event()

        def long_traffic() -> None:
            with triton.InferenceServerClient(server.grpc_url) as client:
                index = 0
                while not stop.is_set():
                    case = index % len(cases)
                    started = time.perf_counter()
                    try:
                        got = infer(client, cases[case])
                        if not np.allclose(got, expected[case], atol=1e-4):
                            errors.append(f"case {case}: wrong answer")
                    except triton.InferenceServerException as err:
                        errors.append(str(err))
                    samples.append((time.time(), time.perf_counter() - started))
                    index += 1

        try:
            before = probe(server.grpc_url)
            print(f"probe at {PROBE} tokens, kernels tuned for short sequences: {before * 1e3:.1f} ms", flush=True)
            client = threading.Thread(target=long_traffic)
            client.start()
            while phase_times(server)[2] is None:
                if server.process.poll() is not None:
                    raise SystemExit("server exited:\n" + server.log()[-3000:])
                time.sleep(1)
            time.sleep(args.after_swap_seconds)
            stop.set()
            client.join()
            after = probe(server.grpc_url)
        finally:
            stop.set()
            server.stop()
        started, checking, swapped = phase_times(server)

    t0 = samples[0][0]
    phases = {"idle": [s for t, s in samples if t < started],
              "re-tuning": [s for t, s in samples if started <= t < checking],
              "checking": [s for t, s in samples if checking <= t < swapped],
              "swapped": [s for t, s in samples if t >= swapped]}
    print(f"\n{'phase':>10} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for name, values in phases.items():
        values = values or [float("nan")]
        print(f"{name:>10} {len(phases[name]):8d} {np.percentile(values, 50) * 1e3:8.1f} "
              f"{np.percentile(values, 99) * 1e3:8.1f}")
    refused = server.log().count(" not swapped in: ")  # versions timed slower than --swap-min-gain, say
    print(f"re-tune and swap took {swapped - started:.0f} s, the check {swapped - checking:.1f} s ({refused} "
          f"version(s) refused first); probe at {PROBE} tokens {before * 1e3:.1f} ms before, {after * 1e3:.1f} ms "
          "after")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 4))
    axes.plot([t - t0 for t, _ in samples], [s * 1e3 for _, s in samples], ".", markersize=3)
    axes.axvspan(started - t0, swapped - t0, color="orange", alpha=0.2, label="re-tuning job running")
    axes.axvline(swapped - t0, color="green", label="swap")
    axes.set_xlabel("seconds")
    axes.set_ylabel("latency ms (256-512 tokens)")
    axes.set_title("all-MiniLM-L6-v2: traffic drifts to long sequences, re-tune, hot swap")
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")

    idle_p99 = np.percentile(phases["idle"], 99) if phases["idle"] else float("nan")
    retune_p99, check_p99 = (np.percentile(phases[name], 99) if phases[name] else float("nan")
                             for name in ("re-tuning", "checking"))
    print(f"RESULT drift_gain={before / after:.2f} p99_during_retune_vs_idle={retune_p99 / idle_p99:.2f} "
          f"p99_during_check_vs_idle={check_p99 / idle_p99:.2f} swap_errors={len(errors)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
