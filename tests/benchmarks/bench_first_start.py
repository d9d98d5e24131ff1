"""A new user's first start: ``python -m dietserve serve`` on a fresh cache (auto-tuning, the
default), under real text from the first second, beside an artifact tuned by hand in the same run.

    python tests/benchmarks/bench_first_start.py [--model default] [--minutes 10] [--concurrency 8]
                                                 [--window 15] [--trials 64] [--png first_start.png]

1. The reference: ``dietserve tune --trials T`` (timed), its artifact served, the same clients for
   half of ``--reference-seconds`` before the first start and half after it; its throughput is the
   median of all its windows.
2. The first start: a fresh ``--cache-dir`` (the model's compile included), ``serve`` with its
   defaults; ``--concurrency`` clients send passages of real text (1-3 sentences of the standard
   library's docstrings) to the text model over gRPC, one request after another, from the moment
   the process starts. Requests before the server listens do not count; failures after it is
   ready do (``errors``). Throughput per ``--window`` seconds until ``--minutes``.

Last line:

    RESULT ready_s=.. swap_s=.. cold_vs_tuned=.. after_swap_vs_tuned=.. settled_s=.. after_job_vs_tuned=..
           errors=..

(ready_s: process start to ready; swap_s: to the tuned version's swap (-1: none); cold_vs_tuned:
the median window between ready and the swap over the reference; after_swap_vs_tuned: the median
window from one window after the swap; settled_s: to the job's outcome, its version swapped in
or refused, or nothing published (-1: none yet); after_job_vs_tuned: the median window from one
window after that, what the server serves once its job is done, whichever version it is.)
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

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.bench_serve import real_passages  # noqa: E402
from tests.integration.scrape import metrics, total  # noqa: E402
from tests.integration.server_process import REPO_ROOT, ServerProcess  # noqa: E402

MODEL = "first"


def text_request(text: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=f"{MODEL}-text")
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    data = text.encode()
    request.raw_input_contents.append(len(data).to_bytes(4, "little") + data)
    request.outputs.add(name="sentence_embedding")
    return request


class Load:
    """``concurrency`` closed-loop clients; each answer's completion time (monotonic) kept."""

    def __init__(self, url_of, texts: list[str], concurrency: int):
        self.url_of, self.requests = url_of, [text_request(t) for t in texts]
        self.done: list[float] = []
        self.errors: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i, concurrency)) for i in range(concurrency)]
        for thread in self._threads:
            thread.start()

    def _client(self, offset: int, step: int) -> None:
        while (url := self.url_of()) is None:  # the server is not listening yet
            if self._stop.wait(0.05):
                return
        with grpc.insecure_channel(url) as channel:
            stub, index = service_pb2_grpc.GRPCInferenceServiceStub(channel), offset
            while not self._stop.is_set():
                try:
                    stub.ModelInfer(self.requests[index % len(self.requests)], timeout=120)
                    self.done.append(time.monotonic())
                except grpc.RpcError as err:
                    self.errors.append((time.monotonic(), f"{err.code()}: {err.details()}"))
                    self._stop.wait(0.1)
                index += step

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)


def windows(done: list[float], start: float, end: float, width: float) -> list[float]:
    """Answers per second in each ``width``-second window from ``start`` to ``end``."""
    count = int((end - start) // width)
    edges = np.searchsorted(np.sort(done), [start + i * width for i in range(count + 1)])
    return [float(edges[i + 1] - edges[i]) / width for i in range(count)]


def tune_reference(args, work: Path) -> float:
    """Tunes the hand-tuned artifact (``work/tuned/artifact``); returns its tuning seconds."""
    started = time.monotonic()
    tuned = subprocess.run([sys.executable, "-m", "dietserve", "tune", *reference_build(args, work), "--trials",
                            str(args.trials), "--db", str(work / "records.jsonl"), "--out", str(work / "tuned")],
                           cwd=REPO_ROOT, capture_output=True, text=True)
    if tuned.returncode != 0:
        raise SystemExit(f"tune failed:\n{tuned.stderr[-3000:]}")
    return time.monotonic() - started


def reference_build(args, work: Path) -> list[str]:
    return ["--model", args.model, "--cache-dir", str(work / "reference-cache")]


def serve_reference(args, texts: list[str], work: Path, seconds: float) -> list[float]:
    """The hand-tuned artifact served to the same clients for ``seconds``: its windows' texts/s."""
    server = ServerProcess(work / "tuned" / "artifact", *reference_build(args, work), model_name=MODEL)
    load = Load(lambda: server.grpc_url, texts, args.concurrency)
    began = time.monotonic()
    time.sleep(seconds)
    load.stop()
    server.stop()
    if load.errors:
        raise SystemExit(f"the reference server failed requests: {load.errors[:3]}")
    return windows(load.done, began + args.window, time.monotonic(), args.window)


def first_start(args, texts: list[str], work: Path):
    """(windows, ready_s, swap_s, errors after ready, the server's log)."""
    command = [sys.executable, "-m", "dietserve", "serve", "--model", args.model, "--model-name", MODEL,
               "--cache-dir", str(work / "fresh-cache"), "--port", "0", "--metrics-port", "0", "--http-port", "0"]
    started = time.monotonic()
    holder: dict[str, object] = {}

    def launch() -> None:  # ServerProcess returns once ready; the clients start on its listening line
        try:
            holder["server"] = ServerProcess(None, command=command)
        except (RuntimeError, TimeoutError) as err:
            holder["error"] = err

    launcher = threading.Thread(target=launch)
    launcher.start()
    load = Load(lambda: getattr(holder.get("server"), "grpc_url", None), texts, args.concurrency)
    launcher.join()
    if "error" in holder:
        load.stop()
        raise SystemExit(f"the first start failed: {holder['error']}")
    server = holder["server"]
    ready_s, swap_s, settled_s = time.monotonic() - started, -1.0, -1.0
    while time.monotonic() - started < args.minutes * 60:
        samples = metrics(server)
        if swap_s < 0 and total(samples, "dietserve_swaps_total") >= 1:
            swap_s = time.monotonic() - started
        outcomes = (total(samples, "dietserve_swaps_total") + total(samples, "dietserve_swap_failures_total")
                    + total(samples, "dietserve_retune_runs_total") - total(samples, "dietserve_retune_runs_total",
                                                                            outcome="published"))
        if settled_s < 0 and outcomes >= 1:
            settled_s = time.monotonic() - started
        time.sleep(1.0)
    load.stop()
    server.stop()
    log = server.log()
    errors = [e for when, e in load.errors if when - started > ready_s]
    series = windows(load.done, started, started + args.minutes * 60, args.window)
    return series, ready_s, swap_s, settled_s, errors, log


def plot(path: Path, series: list[float], width: float, tuned: float, ready_s: float, swap_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4))
    axes.step([i * width for i in range(len(series))], series, where="post", label="first start (auto-tune)")
    axes.axhline(tuned, color="C3", linestyle="--", label="tuned by hand")
    axes.axvline(ready_s, color="C2", linestyle=":", label="ready")
    if swap_s >= 0:
        axes.axvline(swap_s, color="C1", linestyle=":", label="tuned version swapped in")
    axes.set_xlabel("seconds since the process started")
    axes.set_ylabel("texts per second")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument("--trials", type=int, default=64, help="the hand-tuned reference's trials per operator")
    parser.add_argument("--reference-seconds", type=float, default=180.0)
    parser.add_argument("--png", type=Path, default=Path("first_start.png"))
    args = parser.parse_args()
    texts = real_passages(400, seed=3)
    with tempfile.TemporaryDirectory(prefix="dietserve-first-start-") as folder:
        work = Path(folder)
        # The reference served half its time before the first start and half after, so a drift
        # of the shared host's speed over the run falls on both sides alike.
        tuning_s = tune_reference(args, work)
        before = serve_reference(args, texts, work, args.reference_seconds / 2)
        series, ready_s, swap_s, settled_s, errors, log = first_start(args, texts, work)
        after_reference = serve_reference(args, texts, work, args.reference_seconds / 2)
    tuned = statistics.median(before + after_reference)
    swap_window = int(swap_s // args.window) if swap_s >= 0 else len(series)
    cold = [v for i, v in enumerate(series) if ready_s // args.window < i < swap_window]
    after = series[swap_window + 1:] if swap_s >= 0 else []
    print(f"reference: tuned in {tuning_s:.0f} s ({args.trials} trials), {tuned:.1f} texts/s (before the first start "
          f"{statistics.median(before):.1f}, after it {statistics.median(after_reference):.1f})")
    print(f"{'window':>8} {'texts/s':>8}")
    for index, value in enumerate(series):
        mark = " ready" if index == int(ready_s // args.window) else ""
        mark += " swap" if index == swap_window else ""
        print(f"{index * args.window:8.0f} {value:8.1f}{mark}")
    plot(args.png, series, args.window, tuned, ready_s, swap_s)
    # What the server said of its versions: the cold start published, the job's outcome, the
    # swap's side-by-side timing (or why it refused the tuned version).
    for line in log.splitlines():
        if any(word in line for word in ("version", "re-tuning", "retune", "swap", "published")):
            print(f"# server: {line[:300]}")
    cold_ratio = statistics.median(cold) / tuned if cold else float("nan")
    after_ratio = statistics.median(after) / tuned if after else float("nan")
    settled = series[int(settled_s // args.window) + 1:] if settled_s >= 0 else []
    settled_ratio = statistics.median(settled) / tuned if settled else float("nan")
    print(f"RESULT ready_s={ready_s:.1f} swap_s={swap_s:.1f} cold_vs_tuned={cold_ratio:.3f} "
          f"after_swap_vs_tuned={after_ratio:.3f} settled_s={settled_s:.1f} after_job_vs_tuned={settled_ratio:.3f} "
          f"errors={len(errors)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
