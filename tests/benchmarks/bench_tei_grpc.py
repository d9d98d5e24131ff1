"""TEI's gRPC API against the v2 API on one real ``python -m dietserve serve`` process (batching
on): the same real passages (bench_serve.py's), one text a call, embedded

- over v2 gRPC (ModelInfer of the ``-text`` model, one BYTES text), by ``--concurrency`` clients
  each sending its next call when the last is answered;
- over TEI's ``Embed``, the same way;
- over TEI's ``Embed``, one client, call after call (what a client without threads does);
- over one TEI ``EmbedStream`` carrying every text (its messages run ahead of the answers).

    python tests/benchmarks/bench_tei_grpc.py [--model default] [--texts 256] [--concurrency 8] [--rounds 3]

The kinds run in turn within each round, from another kind each round; texts/s is the median
over rounds. Last line:

    RESULT tei_vs_v2=.. stream_vs_one_by_one=.. stream_vs_v2=..

(TEI Embed over v2, both at ``--concurrency`` clients; one stream over call after call; one
stream over v2 at ``--concurrency`` clients.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.compile.artifact import CompileRequest, compile_artifact  # noqa: E402
from dietserve.server._proto import tei_pb2 as tei  # noqa: E402
from dietserve.server._proto import tei_pb2_grpc as tei_grpc  # noqa: E402
from tests.benchmarks.bench_serve import real_passages  # noqa: E402
from tests.integration.server_process import ServerProcess  # noqa: E402

MODEL = "bench"


def v2_text_request(text: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=f"{MODEL}-text")
    request.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text.encode())
    request.outputs.add(name="sentence_embedding")
    return request


def in_threads(channel: grpc.Channel, items: list, concurrency: int, call) -> float:
    """``call(channel, item)`` for every item, by ``concurrency`` threads taking them in turn;
    the seconds it took."""
    started = time.perf_counter()
    threads = [threading.Thread(target=lambda first: [call(channel, item) for item in items[first::concurrency]],
                                args=(first,)) for first in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def timed_kinds(channel: grpc.Channel, texts: list[str], concurrency: int, first: int = 0) -> dict[str, float]:
    """Seconds each kind of load takes to embed ``texts``, the kinds run in turn from the
    ``first`` (rotated from round to round, so that none always runs first)."""
    v2 = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    embed = tei_grpc.EmbedStub(channel)
    v2_requests = [v2_text_request(text) for text in texts]

    def stream() -> float:
        started = time.perf_counter()
        answers = list(embed.EmbedStream(tei.EmbedRequest(inputs=text) for text in texts))
        if len(answers) != len(texts):
            raise RuntimeError(f"the stream answered {len(answers)} of {len(texts)} texts")
        return time.perf_counter() - started

    kinds = {
        "v2 ModelInfer": lambda: in_threads(channel, v2_requests, concurrency,
                                            lambda _, request: v2.ModelInfer(request)),
        "TEI Embed": lambda: in_threads(channel, texts, concurrency,
                                        lambda _, text: embed.Embed(tei.EmbedRequest(inputs=text))),
        "TEI Embed, one by one": lambda: in_threads(channel, texts, 1,
                                                    lambda _, text: embed.Embed(tei.EmbedRequest(inputs=text))),
        "TEI EmbedStream": stream}
    names = list(kinds)
    order = names[first % len(names):] + names[:first % len(names)]
    seconds = {name: kinds[name]() for name in order}
    return {name: seconds[name] for name in names}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dietserve")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    artifact = compile_artifact(CompileRequest(model=args.model, max_batch=16), args.cache_dir,
                                progress=lambda message: print(f"# {message}", file=sys.stderr))
    texts = real_passages(args.texts, seed=0)
    server = ServerProcess(artifact, model_name=MODEL)
    try:
        with grpc.insecure_channel(server.grpc_url) as channel:
            timed_kinds(channel, texts[:32], args.concurrency)  # warm-up
            rounds = [timed_kinds(channel, texts, args.concurrency, first) for first in range(args.rounds)]
    finally:
        server.stop()
    rates = {kind: statistics.median(len(texts) / result[kind] for result in rounds) for kind in rounds[0]}
    print(f"model {args.model}: {len(texts)} real passages, {args.concurrency} clients, {args.rounds} rounds\n")
    print(f"{'kind':<24} {'texts/s':>8}  per round")
    for kind, rate in rates.items():
        print(f"{kind:<24} {rate:8.1f}  {' '.join(f'{len(texts) / result[kind]:.1f}' for result in rounds)}")
    stream = rates["TEI EmbedStream"]
    print(f"\nRESULT tei_vs_v2={rates['TEI Embed'] / rates['v2 ModelInfer']:.3f} "
          f"stream_vs_one_by_one={stream / rates['TEI Embed, one by one']:.3f} "
          f"stream_vs_v2={stream / rates['v2 ModelInfer']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
