"""Soak: many requests against one real ``python -m dietserve serve`` process (batching on).

    python tests/benchmarks/soak.py [--requests 10000] [--concurrency 16] [--model default]

About half the requests go to the ids model (real passages tokenized, then cut or repeated to the drawn
length), half to the text model (runs of real prose long enough to reach it); each has 1..--max-rows rows
(default 1), each row's length drawn uniformly from 1..512 tokens. Request i is a pure function of (seed, i),
so every ``--check-every``-th answer is compared, after the load, with a direct ``Engine.run``
on the same rows (the text rows tokenized by the same TextTokenizer). The server's resident
memory (VmRSS) is read after ``--warmup`` requests and then periodically. Last line:

    RESULT requests=N errors=E checked=K max_abs_err=X rss_warm_mib=A rss_end_mib=B rss_growth_pct=G throughput_rps=T

Exits non-zero on any failed request, malformed answer or answer off by more than ``--atol``.
"""

from __future__ import annotations

import argparse
import itertools
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.compile.artifact import CompileRequest, compile_artifact  # noqa: E402
from dietserve.model.tokenizer import TextTokenizer  # noqa: E402
from dietserve.runtime.artifact import load_artifact  # noqa: E402
from dietserve.runtime.engine import Engine  # noqa: E402
from tests.benchmarks.bench_serve import percentile, real_passages, request_for  # noqa: E402
from tests.integration.server_process import ServerProcess  # noqa: E402

MODEL = "soak"
TEXT_MODEL = f"{MODEL}-text"
RSS_GOAL_PCT = 10.0


@dataclass(frozen=True)
class Request:
    kind: str  # "ids" or "text"
    ids: np.ndarray | None = None  # int64 [rows, seq], zero-padded
    mask: np.ndarray | None = None
    texts: list[str] | None = None

    @property
    def rows(self) -> int:
        return len(self.texts) if self.texts is not None else self.ids.shape[0]


@dataclass(frozen=True)
class Traffic:
    """Request ``i`` of the soak, drawn from real token ids and real prose."""

    passages: list[np.ndarray]  # token ids of real passages, [CLS] ... [SEP]
    words: list[str]  # real prose, passage after passage
    tokens_per_word: float
    max_len: int
    seed: int
    max_rows: int

    @classmethod
    def build(cls, tokenizer: TextTokenizer, max_len: int, seed: int, max_rows: int, count: int = 1000) -> Traffic:
        texts = real_passages(count, seed)
        passages = [tokenizer.encode([text]).input_ids[0] for text in texts]
        words = " ".join(texts).split()
        tokens_per_word = sum(len(p) - 2 for p in passages) / len(words)
        return cls(passages, words, tokens_per_word, max_len, seed, max_rows)

    def request(self, index: int) -> Request:
        rng = np.random.default_rng([self.seed, index])
        lengths = rng.integers(1, self.max_len + 1, size=int(rng.integers(1, self.max_rows + 1)))
        return self._ids(rng, lengths) if rng.random() < 0.5 else self._text(rng, lengths)

    def _ids(self, rng: np.random.Generator, lengths: np.ndarray) -> Request:
        ids = np.zeros((len(lengths), int(lengths.max())), dtype=np.int64)
        for row, length in enumerate(lengths):
            tokens = self.passages[int(rng.integers(len(self.passages)))]
            body = np.resize(tokens[1:-1], max(int(length) - 2, 0))  # cut or repeat the passage
            ids[row, :length] = np.concatenate([tokens[:1], body, tokens[-1:]])[:length]
        return Request("ids", ids=ids, mask=(np.arange(ids.shape[1]) < lengths[:, None]).astype(np.int64))

    def _text(self, rng: np.random.Generator, lengths: np.ndarray) -> Request:
        texts = []
        for length in lengths:
            count = max(1, round((int(length) - 2) / self.tokens_per_word))
            start = int(rng.integers(len(self.words) - count))
            texts.append(" ".join(self.words[start : start + count]))
        return Request("text", texts=texts)


def to_wire(request: Request, index: int) -> service_pb2.ModelInferRequest:
    if request.kind == "ids":
        message = request_for(request.ids, MODEL)  # input_ids, asking for sentence_embedding only
        message.inputs.add(name="attention_mask", datatype="INT64", shape=request.mask.shape)
        message.raw_input_contents.append(np.ascontiguousarray(request.mask, dtype="<i8").tobytes())
        return message
    message = service_pb2.ModelInferRequest(model_name=TEXT_MODEL)
    shape = [request.rows] if index % 2 else [request.rows, 1]  # both shapes the config allows
    message.inputs.add(name="text", datatype="BYTES", shape=shape)
    encoded = [text.encode() for text in request.texts]
    message.raw_input_contents.append(b"".join(struct.pack("<I", len(b)) + b for b in encoded))
    message.outputs.add(name="sentence_embedding")
    return message


def embedding_of(response: service_pb2.ModelInferResponse, rows: int) -> np.ndarray:
    names = [output.name for output in response.outputs]
    if "sentence_embedding" not in names:
        raise ValueError(f"no sentence_embedding among outputs {names}")
    at = names.index("sentence_embedding")
    array = np.frombuffer(response.raw_output_contents[at], dtype="<f4").reshape(tuple(response.outputs[at].shape))
    if array.ndim != 2 or array.shape[0] != rows or not np.isfinite(array).all():
        raise ValueError(f"sentence_embedding of shape {list(array.shape)} for {rows} rows (or not finite)")
    return array


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass
class Soak:
    """Shared state of the client threads; ``record`` is called once per finished request."""

    total: int
    pid: int
    warmup: int
    check_every: int
    started: float = field(default_factory=time.perf_counter)
    done: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: dict = field(default_factory=lambda: {"ids": [], "text": []})
    answers: dict = field(default_factory=dict)  # request index -> sentence_embedding to check
    rss: list[tuple[int, float]] = field(default_factory=list)  # (requests done, MiB)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, index: int, request: Request, seconds: float, answer: np.ndarray | None, error: str) -> None:
        with self.lock:
            self.done += 1
            if error:
                self.errors.append(f"request {index} ({request.kind}, {request.rows} rows): {error}")
            else:
                self.latencies[request.kind].append(seconds)
                if index % self.check_every == 0:
                    self.answers[index] = answer
            every = max(self.total // 20, 1)
            if self.done == self.warmup or (self.done > self.warmup and self.done % every == 0):
                self.rss.append((self.done, rss_mib(self.pid)))
            if self.done % every == 0 or self.done == self.total:
                elapsed = time.perf_counter() - self.started
                print(f"{self.done:>7}/{self.total} requests  {elapsed:6.0f} s  {self.done / elapsed:6.1f} req/s  "
                      f"errors {len(self.errors)}  server RSS {rss_mib(self.pid):.0f} MiB", flush=True)


def drive(url: str, traffic: Traffic, soak: Soak, concurrency: int) -> None:
    indices = itertools.count()  # next() on it is atomic under the GIL

    def client() -> None:
        with grpc.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            while (index := next(indices)) < soak.total:
                request = traffic.request(index)
                message = to_wire(request, index)
                start = time.perf_counter()
                answer, error = None, ""
                try:
                    answer = embedding_of(stub.ModelInfer(message, timeout=120), request.rows)
                except grpc.RpcError as err:
                    error = f"{err.code()}: {err.details()}"
                except ValueError as err:
                    error = f"malformed answer: {err}"
                soak.record(index, request, time.perf_counter() - start, answer, error)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def check(soak: Soak, traffic: Traffic, engine: Engine, tokenizer: TextTokenizer, atol: float):
    """(largest |served - direct| over the sampled answers, the wrong ones, tokens of each sampled
    row by model), the same rows run directly on the VM."""
    worst, wrong, row_tokens = 0.0, [], {"ids": [], "text": []}
    for index, answer in sorted(soak.answers.items()):
        request = traffic.request(index)
        if request.kind == "ids":
            ids, mask = request.ids, request.mask
            expected = engine.run(ids, mask, np.zeros_like(ids)).sentence_embedding
        else:
            encoded = tokenizer.encode(request.texts)
            mask = encoded.attention_mask
            expected = engine.run(encoded.input_ids, mask, encoded.token_type_ids).sentence_embedding
        err = float(np.abs(answer - expected).max()) if answer.shape == expected.shape else float("inf")
        worst = max(worst, err)
        if not err <= atol:
            wrong.append(f"request {index} ({request.kind}, {request.rows} rows): max |diff| {err:.3g}")
        row_tokens[request.kind].append(mask.sum(axis=1).tolist())
    return worst, wrong, row_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dietserve")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1000, help="requests before the first RSS reading")
    parser.add_argument("--check-every", type=int, default=50, help="compare every Nth answer with the VM")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rows", type=int, default=1,
                        help="rows per request drawn from 1..N (default 1: 10,000 requests of up to 512 tokens "
                             "take ~15 min on 2 cores with the untuned MiniLM)")
    args = parser.parse_args()

    artifact = compile_artifact(CompileRequest(model=args.model, max_batch=max(16, args.max_batch_size)),
                                args.cache_dir, progress=lambda m: print(f"# {m}", file=sys.stderr))
    engine = Engine(load_artifact(artifact))
    tokenizer = TextTokenizer.from_folder(artifact, engine.max_seq_len)
    traffic = Traffic.build(tokenizer, engine.max_seq_len, args.seed, args.max_rows)
    warmup = min(args.warmup, args.requests // 2)
    print(f"model {args.model}: {args.requests} requests at concurrency {args.concurrency}, ids to {MODEL!r} "
          f"and text to {TEXT_MODEL!r}; RSS from request {warmup}, every {args.check_every}th answer checked")

    server = ServerProcess(artifact, "--max-batch-size", str(args.max_batch_size), model_name=MODEL)
    try:
        soak = Soak(args.requests, server.process.pid, warmup, args.check_every)
        drive(server.grpc_url, traffic, soak, args.concurrency)
        seconds = time.perf_counter() - soak.started
        soak.rss.append((soak.done, rss_mib(server.process.pid)))
    finally:
        server.stop()

    worst, wrong, row_tokens = check(soak, traffic, engine, tokenizer, args.atol)
    print(f"\n{'model':>6} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'checked':>7}  "
          "tokens of the checked rows p10/p50/p90/max")
    for kind, latencies in soak.latencies.items():
        latencies, tokens = latencies or [np.nan], [n for rows in row_tokens[kind] for n in rows] or [0]
        print(f"{kind:>6} {len(soak.latencies[kind]):8d} {percentile(latencies, 50) * 1e3:8.1f} "
              f"{percentile(latencies, 99) * 1e3:8.1f} {len(row_tokens[kind]):7d}  {percentile(tokens, 10):.0f}/"
              f"{percentile(tokens, 50):.0f}/{percentile(tokens, 90):.0f}/{max(tokens)}")
    print("server RSS MiB by requests done: " + ", ".join(f"{done}: {mib:.0f}" for done, mib in soak.rss))
    for line in (soak.errors[:5] + wrong[:5]):
        print(f"FAILED {line}")
    rss_warm, rss_end = soak.rss[0][1], soak.rss[-1][1]
    growth = (rss_end - rss_warm) / rss_warm * 100
    print(f"RSS growth after warm-up {growth:+.1f}% (goal < {RSS_GOAL_PCT:.0f}%: "
          f"{'met' if growth < RSS_GOAL_PCT else 'MISSED'})")
    print(f"RESULT requests={soak.done} errors={len(soak.errors)} checked={len(soak.answers)} max_abs_err={worst:.3g} "
          f"rss_warm_mib={rss_warm:.0f} rss_end_mib={rss_end:.0f} rss_growth_pct={growth:.1f} "
          f"throughput_rps={soak.done / seconds:.1f}")
    return 1 if soak.errors or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
