"""Closed-loop gRPC load on loopback against a real ``python -m dietserve serve`` process.

    python tests/benchmarks/bench_serve.py [--model default|bert-base|DIR] [--seconds 12]
                                           [--concurrency 1 8] [--max-batch-size 8]

Sequence lengths follow real text: passages of 1-3 consecutive sentences from the Python
standard library's docstrings, tokenized by the model's own tokenizer (short queries and longer
passages, as an embedding service sees). Each client sends its next request as soon as the last
one is answered. For batching off and on, and each concurrency, the table shows throughput and
p50/p99 latency; then the server's overhead: median latency of one fixed request through gRPC
(batching off, one client) minus the median of the same request run directly on the VM, measured
in interleaved blocks. Last line:

    RESULT throughput_rps=X p50_ms=Y p99_ms=Z overhead_p50_us=W

(throughput and latency: batching on at the highest concurrency).
"""

from __future__ import annotations

import argparse
import inspect
import pkgutil
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.compile.artifact import CompileRequest, compile_artifact  # noqa: E402
from dietserve.model.tokenizer import TextTokenizer  # noqa: E402
from dietserve.runtime.artifact import load_artifact  # noqa: E402
from dietserve.runtime.engine import Engine  # noqa: E402
from tests.integration.server_process import ServerProcess  # noqa: E402

MODEL = "bench"
SENTENCE = re.compile(r"(?<=[.!?])\s+")


def real_passages(count: int, seed: int) -> list[str]:
    """Passages of 1-3 sentences from standard-library docstrings (real English prose)."""
    import importlib

    sentences = []
    for module_info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if module_info.name.startswith("_") or module_info.name in ("antigravity", "this", "idlelib", "tkinter"):
            continue
        if not hasattr(module_info.module_finder, "path") or "site-packages" in str(module_info.module_finder.path):
            continue
        try:
            module = importlib.import_module(module_info.name)
        except Exception:  # noqa: BLE001 - some stdlib modules need optional system libraries
            continue
        for _name, member in inspect.getmembers(module):
            doc = inspect.getdoc(member) if callable(member) else None
            if doc:
                for paragraph in doc.split("\n\n"):
                    text = " ".join(paragraph.split())
                    if text and text[0].isalpha() and len(text) > 20:
                        sentences.extend(s for s in SENTENCE.split(text) if len(s) > 10)
        if len(sentences) > 20 * count:
            break
    rng = np.random.default_rng(seed)
    passages = []
    for _ in range(count):
        start = int(rng.integers(0, len(sentences) - 3))
        passages.append(" ".join(sentences[start : start + int(rng.integers(1, 4))]))
    return passages


def request_for(ids: np.ndarray) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="input_ids", datatype="INT64", shape=ids.shape)
    request.raw_input_contents.append(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    request.outputs.add(name="sentence_embedding")
    return request


def closed_loop(url: str, requests: list, concurrency: int, seconds: float) -> tuple[float, list[float]]:
    """(requests per second, latencies in seconds) of ``concurrency`` clients for ``seconds``."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds
    errors: list[str] = []

    def client(offset: int) -> None:
        with grpc.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            mine, index = [], offset
            while time.perf_counter() < stop_at:
                request = requests[index % len(requests)]
                index += concurrency
                start = time.perf_counter()
                try:
                    stub.ModelInfer(request, timeout=60)
                except grpc.RpcError as err:
                    errors.append(f"{err.code()}: {err.details()}")
                    return
                mine.append(time.perf_counter() - start)
            with lock:
                latencies.extend(mine)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return len(latencies) / (time.perf_counter() - started), latencies


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def overhead(url: str, engine: Engine, ids: np.ndarray, blocks: int = 7, per_block: int = 40):
    """Median seconds of one request run directly on the VM, of the same request through gRPC,
    and of an empty RPC (ServerLive: the transport's floor), interleaved in blocks."""
    request = request_for(ids)
    mask, types = np.ones_like(ids), np.zeros_like(ids)
    direct, served, empty = [], [], []
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(5):  # warm both paths
            stub.ModelInfer(request, timeout=60)
            engine.execute(ids, mask, types)
        for _ in range(blocks):
            for _ in range(per_block):
                start = time.perf_counter()
                engine.execute(ids, mask, types)
                direct.append(time.perf_counter() - start)
            time.sleep(0.2)
            for _ in range(per_block):
                start = time.perf_counter()
                stub.ModelInfer(request, timeout=60)
                served.append(time.perf_counter() - start)
            for _ in range(per_block):
                start = time.perf_counter()
                stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=60)
                empty.append(time.perf_counter() - start)
            time.sleep(0.2)
    return statistics.median(direct), statistics.median(served), statistics.median(empty)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dietserve")
    parser.add_argument("--seconds", type=float, default=12.0, help="load per configuration")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-queue-delay-ms", type=float, default=2.0)
    parser.add_argument("--bucket-ratio", type=float, default=None, help="server default if not given")
    parser.add_argument("--requests", type=int, default=400, help="distinct requests in the rotation")
    args = parser.parse_args()

    artifact = compile_artifact(CompileRequest(model=args.model, max_batch=max(16, args.max_batch_size)),
                                args.cache_dir, progress=lambda m: print(f"# {m}", file=sys.stderr))
    engine = Engine(load_artifact(artifact))
    tokenizer = TextTokenizer.from_folder(artifact, engine.max_seq_len)
    passages = real_passages(args.requests, seed=0)
    encoded = [tokenizer.encode([p]).input_ids for p in passages]
    lengths = [ids.shape[1] for ids in encoded]
    requests = [request_for(ids) for ids in encoded]
    print(f"model {args.model}: {len(requests)} requests, tokens per request p10/p50/p90/max = "
          f"{percentile(lengths, 10):.0f}/{percentile(lengths, 50):.0f}/{percentile(lengths, 90):.0f}/"
          f"{max(lengths)}; {engine.threads} CPU threads")

    rows, results = [], {}
    overhead_us = None
    for batching in (False, True):
        flags = ["--max-batch-size", str(args.max_batch_size), "--max-queue-delay-ms", str(args.max_queue_delay_ms)]
        if not batching:
            flags.append("--no-batching")
        if args.bucket_ratio is not None:
            flags += ["--bucket-ratio", str(args.bucket_ratio)]
        server = ServerProcess(artifact, *flags, model_name=MODEL)
        try:
            if not batching:
                median_ids = encoded[int(np.argsort(lengths)[len(lengths) // 2])]
                direct, served, empty = overhead(server.grpc_url, engine, median_ids)
                overhead_us = (served - direct) * 1e6
                print(f"overhead at seq {median_ids.shape[1]}: direct VM {direct * 1e3:.3f} ms, "
                      f"gRPC {served * 1e3:.3f} ms, server overhead {overhead_us:.0f} us "
                      f"(an empty RPC, ServerLive, takes {empty * 1e6:.0f} us on this channel)")
            for concurrency in args.concurrency:
                closed_loop(server.grpc_url, requests, concurrency, 1.5)  # warm-up
                rps, latencies = closed_loop(server.grpc_url, requests, concurrency, args.seconds)
                results[(batching, concurrency)] = (rps, latencies)
                rows.append((("on" if batching else "off"), concurrency, rps, percentile(latencies, 50) * 1e3,
                             percentile(latencies, 99) * 1e3, len(latencies)))
                time.sleep(0.5)
        finally:
            server.stop()

    print(f"\n{'batching':>8} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'requests':>8}")
    for batching, concurrency, rps, p50, p99, count in rows:
        print(f"{batching:>8} {concurrency:>7} {rps:8.1f} {p50:8.2f} {p99:8.2f} {count:8d}")
    top = max(args.concurrency)
    on_rps, on_latencies = results[(True, top)]
    off_rps = results[(False, top)][0]
    print(f"\nbatching on / off throughput at {top} clients: {on_rps / off_rps:.2f}x")
    print(f"RESULT throughput_rps={on_rps:.1f} p50_ms={percentile(on_latencies, 50) * 1e3:.2f} "
          f"p99_ms={percentile(on_latencies, 99) * 1e3:.2f} overhead_p50_us={overhead_us:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
