"""Where a request's time goes inside the server, measured with py-spy (a sampling profiler that
reads the server process from outside, so the server runs unmodified).

    python tests/benchmarks/profile_serve.py [--model default] [--seq 48] [--seconds 10] [SERVER FLAGS...]

One client sends the same request (``--seq`` tokens) back to back to a real server process while
py-spy samples every thread of the server. Prints, per thread, the share of samples spent in each
of the server's own functions (inclusive) and the top native leaves, then the server-side split of
one request from its statistics (queue, compute) beside the client's latency. Needs py-spy
(``pip install py-spy``; it is in the ``test`` extra) and permission to ptrace the server.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.compile.artifact import CompileRequest, compile_artifact  # noqa: E402
from tests.benchmarks.bench_serve import MODEL, request_for  # noqa: E402
from tests.integration.server_process import ServerProcess  # noqa: E402


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy not found: pip install py-spy")
    return found


def summarise(raw: Path, top: int) -> None:
    """py-spy's raw format: one line per distinct stack, 'frame;frame;...;frame COUNT'."""
    per_thread: dict[str, Counter] = defaultdict(Counter)
    leaves: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]  # "thread (0x7f...): dietserve-infer_0"
        count = int(count)
        totals[thread] += count
        seen = set()
        for frame in frames[1:]:
            if "dietserve/" in frame or "grpc" in frame or "asyncio" in frame:
                name = frame.split(" (")[0] + " (" + frame.split(" (")[-1].split("/")[-1]
                if name not in seen:
                    per_thread[thread][name] += count
                    seen.add(name)
        leaves[thread][frames[-1].split(" (")[0] + " (" + frames[-1].split("/")[-1]] += count
    for thread, total in totals.most_common():
        if total < 0.01 * sum(totals.values()):
            continue
        print(f"\nthread {thread}: {total} samples")
        for name, count in per_thread[thread].most_common(top):
            print(f"  {100 * count / total:5.1f}%  {name}")
        print("  leaves: " + "; ".join(f"{name} {100 * c / total:.0f}%" for name, c in leaves[thread].most_common(4)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dietserve")
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=400, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=14)
    args, server_flags = parser.parse_known_args()

    artifact = compile_artifact(CompileRequest(model=args.model, max_batch=16), args.cache_dir,
                                progress=lambda m: print(f"# {m}", file=sys.stderr))
    server = ServerProcess(artifact, *(server_flags or ["--no-batching"]), model_name=MODEL)
    request = request_for(np.full((1, args.seq), 2000, np.int64))
    latencies: list[float] = []
    try:
        with grpc.insecure_channel(server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(20):
                stub.ModelInfer(request, timeout=60)
            before = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=MODEL)).model_stats[0]
            stop = threading.Event()

            def load() -> None:
                while not stop.is_set():
                    started = time.perf_counter()
                    stub.ModelInfer(request, timeout=60)
                    latencies.append(time.perf_counter() - started)

            client = threading.Thread(target=load)
            client.start()
            with tempfile.TemporaryDirectory() as scratch:
                raw = Path(scratch) / "profile.txt"
                recorded = subprocess.run(
                    [py_spy(), "record", "--pid", str(server.process.pid), "--rate", str(args.rate), "--duration",
                     str(int(args.seconds)), "--format", "raw", "--threads", "--nonblocking", "--output", str(raw)],
                    capture_output=True, text=True)
                stop.set()
                client.join()
                if recorded.returncode != 0:
                    raise SystemExit(f"py-spy failed:\n{recorded.stdout}\n{recorded.stderr}")
                summarise(raw, args.top)
            after = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=MODEL)).model_stats[0]
    finally:
        server.stop()
    count = after.inference_stats.success.count - before.inference_stats.success.count

    def per_request(name: str) -> float:
        return (getattr(after.inference_stats, name).ns - getattr(before.inference_stats, name).ns) / count / 1e3

    print(f"\n{count} requests of {args.seq} tokens: client p50 {np.median(latencies) * 1e3:.3f} ms; server "
          f"request {per_request('success'):.0f} us = queue {per_request('queue'):.0f} us + compute "
          f"{per_request('compute_infer'):.0f} us + the rest "
          f"{per_request('success') - per_request('queue') - per_request('compute_infer'):.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
