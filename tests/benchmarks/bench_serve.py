"""Closed-loop gRPC and HTTP load on loopback against a real ``python -m dietserve serve`` process.

    python tests/benchmarks/bench_serve.py [--model default|bert-base|DIR] [--seconds 12]
                                           [--concurrency 1 8] [--max-batch-size 8] [--skip-perf-analyzer]
                                           [--skip-http]

Sequence lengths follow real text: passages of 1-3 consecutive sentences from the Python
standard library's docstrings, tokenized by the model's own tokenizer (short queries and longer
passages, as an embedding service sees). Each client sends its next request as soon as the last
one is answered. For batching off and on, and each concurrency, the table shows throughput and
p50/p99 latency over gRPC (ModelInfer, raw INT64) and over HTTP (OpenAI /v1/embeddings with the
same token ids, base64 answers as the openai package asks, one keep-alive http.client connection
per client), and HTTP's throughput ratio and p50
difference against gRPC. Then:

- the server's overhead: median latency of one fixed request through gRPC (batching off, one
  client) minus the median of the same request run directly on the VM, beside the median of an
  empty RPC (ServerLive) on the same channel, measured in interleaved blocks; and where the
  overhead goes, from the server's own statistics (queue = hand-off to the execution thread,
  compute, the rest of the handler) and the transport (client latency minus server latency);
- Triton's perf_analyzer (tests/benchmarks/perf_analyzer.py) against the ids model at
  concurrency 1, 4 and 16 with the same real passages as its input data, its summary quoted.

With ``--texts-per-request 16`` it measures instead what indexing documents is: each request
carries 16 texts (padded to its longest, with their attention mask), beside requests of one text
each, at each concurrency, batching on, for the packed artifact (the CPU default) and the
padded one; ``--rounds`` rounds alternate the two kinds of request; texts/s (the median over
rounds, and each round's) and p50/p99 per request over all rounds. Last line ``RESULT multi_text_ratio_packed=..
multi_text_ratio_padded=.. packed_vs_padded_multi=..`` (texts/s with 16 a request over texts/s
with one, at the highest concurrency; and the two layouts' texts/s with 16 a request).

Otherwise the last line:

    RESULT throughput_rps=X p50_ms=Y p99_ms=Z overhead_p50_us=W empty_rpc_p50_us=E batching_gain_8=G
           lone_request_ratio=L [http_throughput_ratio=R http_p50_extra_us=D]

(throughput and latency: batching on at the highest concurrency; batching_gain_8: throughput on
/ off at 8 clients; lone_request_ratio: p50 on / off at 1 client; http_throughput_ratio: HTTP /
gRPC throughput, batching on, highest concurrency; http_p50_extra_us: HTTP p50 - gRPC p50,
batching off, one client: the HTTP layer's own cost.)
"""

from __future__ import annotations

import argparse
import inspect
import json
import pkgutil
import re
import statistics
import sys
import tempfile
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
        if module_info.name not in sys.stdlib_module_names:  # never import (run) a script beside this one
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


def request_for(ids: np.ndarray, model: str = MODEL, mask: np.ndarray | None = None) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        if array is not None:
            request.inputs.add(name=name, datatype="INT64", shape=array.shape)
            request.raw_input_contents.append(np.ascontiguousarray(array, dtype="<i8").tobytes())
    request.outputs.add(name="sentence_embedding")
    return request


def multi_text_runs(args: argparse.Namespace) -> int:
    """Requests of ``--texts-per-request`` texts beside requests of one, packed and padded layouts."""
    per_request = args.texts_per_request
    passages = real_passages(args.requests, seed=0)
    rows, texts_per_s = [], {}
    for layout in ("packed", "padded"):
        artifact = compile_artifact(CompileRequest(model=args.model, max_batch=max(per_request, args.max_batch_size),
                                                   analytic=True, layout=layout), args.cache_dir,
                                    progress=lambda m: print(f"# {m}", file=sys.stderr))
        tokenizer = TextTokenizer.from_folder(artifact, Engine(load_artifact(artifact)).max_seq_len)
        single = [request_for(tokenizer.encode([p]).input_ids) for p in passages]
        groups = [passages[i:i + per_request] for i in range(0, len(passages) - per_request + 1, per_request)]
        multi = []
        for group in groups:
            encoded = tokenizer.encode(group)
            multi.append(request_for(encoded.input_ids, mask=encoded.attention_mask))
        flags = ["--max-batch-size", str(args.max_batch_size), "--max-queue-delay-ms", str(args.max_queue_delay_ms),
                 "--max-queue-rows", str(4 * per_request * max(args.concurrency))]
        server = ServerProcess(artifact, *flags, model_name=MODEL)
        try:
            for concurrency in args.concurrency:
                # Rounds alternating the two kinds of request, the order swapped each round: this
                # host's speed drifts by 10% within minutes, which one run of each would read as
                # a difference between them.
                rates, latencies = {1: [], per_request: []}, {1: [], per_request: []}
                kinds = [(1, single), (per_request, multi)]
                for round_index in range(args.rounds):
                    for texts, requests in kinds if round_index % 2 == 0 else reversed(kinds):
                        closed_loop(server.grpc_url, requests, concurrency, 1.5)  # warm-up
                        rps, answered = closed_loop(server.grpc_url, requests, concurrency, args.seconds)
                        rates[texts].append(rps * texts)
                        latencies[texts].extend(answered)
                        time.sleep(0.5)
                for texts in rates:
                    texts_per_s[layout, texts, concurrency] = statistics.median(rates[texts])
                    rows.append((layout, texts, concurrency, rates[texts], percentile(latencies[texts], 50) * 1e3,
                                 percentile(latencies[texts], 99) * 1e3, len(latencies[texts])))
        finally:
            server.stop()
    print(f"\n{'layout':>7} {'texts/req':>9} {'clients':>7} {'texts/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'requests':>8}"
          f"  texts/s per round")
    for layout, texts, concurrency, rates, p50, p99, count in rows:
        print(f"{layout:>7} {texts:>9} {concurrency:>7} {statistics.median(rates):8.1f} {p50:8.2f} {p99:8.2f} "
              f"{count:8d}  {', '.join(f'{rate:.1f}' for rate in rates)}")
    top = max(args.concurrency)
    multi = {layout: texts_per_s[layout, per_request, top] for layout in ("packed", "padded")}
    ratio = {layout: multi[layout] / texts_per_s[layout, 1, top] for layout in multi}
    print(f"RESULT multi_text_ratio_packed={ratio['packed']:.2f} multi_text_ratio_padded={ratio['padded']:.2f} "
          f"packed_vs_padded_multi={multi['packed'] / multi['padded']:.2f}")
    return 0


def _run_clients(client, concurrency: int, latencies: list[float], errors: list[str]) -> tuple[float, list[float]]:
    """Runs ``client(offset)`` on ``concurrency`` threads; (requests per second, latencies)."""
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return len(latencies) / (time.perf_counter() - started), latencies


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

    return _run_clients(client, concurrency, latencies, errors)


def closed_loop_http(url: str, encoded: list[np.ndarray], concurrency: int,
                     seconds: float) -> tuple[float, list[float]]:
    """:func:`closed_loop` over HTTP: the same token ids to OpenAI's /v1/embeddings, answers in
    base64 as the ``openai`` package asks for them by default, each client on one keep-alive
    connection of the standard library's ``http.client`` (a client as light as the gRPC one: on
    a small host the clients share the server's cores)."""
    import http.client

    bodies = [json.dumps({"model": MODEL, "input": ids[0].tolist(), "encoding_format": "base64"}).encode()
              for ids in encoded]
    host, port = url.rsplit(":", 1)
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds
    errors: list[str] = []

    def client(offset: int) -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        mine, index = [], offset
        try:
            while time.perf_counter() < stop_at:
                body = bodies[index % len(bodies)]
                index += concurrency
                start = time.perf_counter()
                connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                answer = connection.getresponse()
                payload = answer.read()
                if answer.status != 200:
                    errors.append(f"{answer.status}: {payload[:200]!r}")
                    return
                mine.append(time.perf_counter() - start)
        finally:
            connection.close()
        with lock:
            latencies.extend(mine)

    return _run_clients(client, concurrency, latencies, errors)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def _server_totals(stub) -> dict[str, float]:
    stats = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=MODEL), timeout=60).model_stats[0]
    inference = stats.inference_stats
    return {"count": inference.success.count, "request": inference.success.ns, "queue": inference.queue.ns,
            "compute": inference.compute_infer.ns}


def overhead(url: str, engine: Engine, ids: np.ndarray, blocks: int = 7, per_block: int = 40):
    """Median seconds of one request run directly on the VM, of the same request through gRPC,
    and of an empty RPC (ServerLive: the transport's floor), interleaved in blocks; and the
    server's mean split of the served requests (seconds: request, queue, compute)."""
    request = request_for(ids)
    mask, types = np.ones_like(ids), np.zeros_like(ids)
    direct, served, empty = [], [], []
    split = {"count": 0, "request": 0, "queue": 0, "compute": 0}
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
            time.sleep(0.2)  # let this process's kernel threads stop spinning
            before = _server_totals(stub)
            for _ in range(per_block):
                start = time.perf_counter()
                stub.ModelInfer(request, timeout=60)
                served.append(time.perf_counter() - start)
            after = _server_totals(stub)
            for key in split:
                split[key] += after[key] - before[key]
            for _ in range(per_block):
                start = time.perf_counter()
                stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=60)
                empty.append(time.perf_counter() - start)
            time.sleep(0.2)
    # The server reports sums, so its split is in means; the client's mean goes beside them.
    server_split = {key: split[key] / split["count"] / 1e9 for key in ("request", "queue", "compute")}
    server_split["client_mean"] = statistics.fmean(served)
    server_split["direct_mean"] = statistics.fmean(direct)
    return statistics.median(direct), statistics.median(served), statistics.median(empty), server_split


def perf_analyzer_runs(url: str, encoded: list[np.ndarray], cache_dir: Path, concurrencies=(1, 4, 16)) -> None:
    """Triton's perf_analyzer against the ids model, its own summary lines quoted."""
    from tests.benchmarks.perf_analyzer import (
        PerfAnalyzerError,
        ensure_perf_analyzer,
        run_perf_analyzer,
        write_input_data,
    )

    try:
        run_sh = ensure_perf_analyzer(cache_dir)
    except PerfAnalyzerError as err:
        print(f"\nperf_analyzer unavailable, skipped: {err}")
        return
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "input.json"
        write_input_data(data, encoded)
        for concurrency in concurrencies:
            lines, rps, p50, p99 = run_perf_analyzer(run_sh, url, MODEL, concurrency, data)
            print(f"\nperf_analyzer, concurrency {concurrency}: {rps:.1f} infer/s, p50 {p50 / 1e3:.2f} ms, "
                  f"p99 {p99 / 1e3:.2f} ms; its summary:")
            for line in lines:
                print(f"    | {line}")


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
    parser.add_argument("--skip-perf-analyzer", action="store_true")
    parser.add_argument("--skip-http", action="store_true", help="gRPC only")
    parser.add_argument("--rounds", type=int, default=3, help="--texts-per-request: rounds of each kind of request")
    parser.add_argument("--texts-per-request", type=int, default=1,
                        help="above 1: requests of this many texts beside requests of one, packed and padded layouts")
    args = parser.parse_args()
    if args.texts_per_request > 1:
        return multi_text_runs(args)

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

    rows, results, http_results = [], {}, {}
    overhead_us = empty_us = None
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
                direct, served, empty, split = overhead(server.grpc_url, engine, median_ids)
                overhead_us, empty_us = (served - direct) * 1e6, empty * 1e6
                rest = split["request"] - split["queue"] - split["compute"]
                print(f"overhead at seq {median_ids.shape[1]}: direct VM {direct * 1e3:.3f} ms, "
                      f"gRPC {served * 1e3:.3f} ms, server overhead {overhead_us:.0f} us; an empty RPC "
                      f"(ServerLive) takes {empty_us:.0f} us on this channel")
                print(f"  means: client {split['client_mean'] * 1e6:.0f} us = server {split['request'] * 1e6:.0f} us "
                      f"(compute {split['compute'] * 1e6:.0f} us vs {split['direct_mean'] * 1e6:.0f} us direct, "
                      f"hand-off to the execution thread {split['queue'] * 1e6:.0f} us, rest of the handler "
                      f"{rest * 1e6:.0f} us) + transport {(split['client_mean'] - split['request']) * 1e6:.0f} us")
            for concurrency in args.concurrency:
                closed_loop(server.grpc_url, requests, concurrency, 1.5)  # warm-up
                rps, latencies = closed_loop(server.grpc_url, requests, concurrency, args.seconds)
                results[(batching, concurrency)] = (rps, latencies)
                rows.append((("on" if batching else "off"), "grpc", concurrency, rps, percentile(latencies, 50) * 1e3,
                             percentile(latencies, 99) * 1e3, len(latencies)))
                time.sleep(0.5)
                if not args.skip_http:
                    closed_loop_http(server.http_url, encoded, concurrency, 1.5)  # warm-up
                    rps, latencies = closed_loop_http(server.http_url, encoded, concurrency, args.seconds)
                    http_results[(batching, concurrency)] = (rps, latencies)
                    rows.append((("on" if batching else "off"), "http", concurrency, rps,
                                 percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3, len(latencies)))
                    time.sleep(0.5)
            if batching and not args.skip_perf_analyzer:
                perf_analyzer_runs(server.grpc_url, encoded, args.cache_dir / "perf_analyzer")
        finally:
            server.stop()

    print(f"\n{'batching':>8} {'wire':>5} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'requests':>8}")
    for batching, wire, concurrency, rps, p50, p99, count in rows:
        print(f"{batching:>8} {wire:>5} {concurrency:>7} {rps:8.1f} {p50:8.2f} {p99:8.2f} {count:8d}")
    top, low = max(args.concurrency), min(args.concurrency)
    on_rps, on_latencies = results[(True, top)]
    gain = on_rps / results[(False, top)][0]
    lone = percentile(results[(True, low)][1], 50) / percentile(results[(False, low)][1], 50)
    print(f"\nbatching on / off throughput at {top} clients: {gain:.2f}x (goal >= 1.2x); p50 on / off at {low} "
          f"client(s): {lone:.3f} (goal <= 1.05); overhead p50 {overhead_us:.0f} us vs empty RPC {empty_us:.0f} us "
          f"(goal <= empty + 200 us)")
    http = ""
    if http_results:
        ratio = http_results[(True, top)][0] / on_rps
        extra_us = (percentile(http_results[(False, low)][1], 50) - percentile(results[(False, low)][1], 50)) * 1e6
        print(f"HTTP / gRPC throughput at {top} clients, batching on: {ratio:.2f}x (goal >= 0.9x); HTTP p50 - gRPC p50 "
              f"at {low} client(s), batching off: {extra_us:.0f} us (goal <= 300 us)")
        http = f" http_throughput_ratio={ratio:.2f} http_p50_extra_us={extra_us:.0f}"
    print(f"RESULT throughput_rps={on_rps:.1f} p50_ms={percentile(on_latencies, 50) * 1e3:.2f} "
          f"p99_ms={percentile(on_latencies, 99) * 1e3:.2f} overhead_p50_us={overhead_us:.0f} "
          f"empty_rpc_p50_us={empty_us:.0f} batching_gain_{top}={gain:.2f} lone_request_ratio={lone:.3f}{http}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
