"""The HTTP framework choice, measured: aiohttp on the gRPC server's loop (what `serve` runs)
beside FastAPI on uvicorn (the KServe Python server's stack) on that same loop, and beside
uvicorn on a thread of its own, each request handed to the inference core's loop and back.

All three serve the same OpenAI-shaped `POST /v1/embeddings` over the same stand-in inference
core: a coroutine on the core's loop that parses the request and answers one 384-float base64
embedding per input after one turn of the loop, as the batcher's future resolves. The model's
time is the same under any framework, so only what the choice changes is timed. Clients run in
another process (closed loop, keep-alive `http.client`, as light as bench_serve.py's): p50 with
one client, requests a second with eight; the variants alternate over ``--rounds``.

    .venv/bin/python tests/benchmarks/bench_http_frameworks.py [--seconds 8] [--rounds 3]

Last line: ``RESULT fastapi_same_loop_vs_aiohttp=.. uvicorn_thread_vs_aiohttp=..`` (throughput at
eight clients, above 1: faster than aiohttp).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import json
import multiprocessing
import statistics
import threading
import time

import numpy as np
from fastapi import Request  # at module level: FastAPI resolves the handler's annotations here

DIMENSIONS = 384
BODY = json.dumps({"model": "m", "input": ["A man is eating food while reading the news."],
                   "encoding_format": "base64"}).encode()
EMBEDDING = base64.b64encode(np.random.default_rng(0).standard_normal(DIMENSIONS).astype(np.float32)).decode()


async def core(body: dict) -> dict:
    """The stand-in inference core: checks the body as the OpenAI route does, yields once."""
    texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
    await asyncio.sleep(0)
    return {"object": "list", "model": body["model"],
            "data": [{"object": "embedding", "index": i, "embedding": EMBEDDING} for i in range(len(texts))],
            "usage": {"prompt_tokens": 12 * len(texts), "total_tokens": 12 * len(texts)}}


async def start_aiohttp() -> tuple[int, object]:
    from aiohttp import web

    async def embeddings(request: web.Request) -> web.Response:
        return web.json_response(await core(await request.json()))

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return site._server.sockets[0].getsockname()[1], runner.cleanup


def _fastapi_app(call_core):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        return JSONResponse(await call_core(await request.json()))

    return app


async def _serve_uvicorn(app) -> tuple[object, int]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning",
                                           access_log=False))
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return (server, task), server.servers[0].sockets[0].getsockname()[1]


async def start_fastapi_same_loop() -> tuple[int, object]:
    (server, task), port = await _serve_uvicorn(_fastapi_app(core))

    async def stop() -> None:
        server.should_exit = True
        await task

    return port, stop


async def start_uvicorn_thread() -> tuple[int, object]:
    """uvicorn (its default loop: uvloop here) on its own thread; each request's core call is
    handed to this loop, the core's, and its answer back."""
    core_loop = asyncio.get_running_loop()

    async def call_core(body: dict) -> dict:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(core(body), core_loop))

    ready, holder = threading.Event(), {}

    def run() -> None:
        import uvloop

        async def main() -> None:
            (server, task), holder["port"] = await _serve_uvicorn(_fastapi_app(call_core))
            holder["server"] = server
            ready.set()
            await task

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # uvicorn's own choice
            runner.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    await asyncio.get_running_loop().run_in_executor(None, ready.wait)

    async def stop() -> None:
        holder["server"].should_exit = True
        await asyncio.get_running_loop().run_in_executor(None, thread.join)

    return holder["port"], stop


VARIANTS = {"aiohttp (same loop)": start_aiohttp, "fastapi+uvicorn (same loop)": start_fastapi_same_loop,
            "fastapi+uvicorn (own thread)": start_uvicorn_thread}


def _client(port: int, latencies: list, stop_at: float) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        connection.request("POST", "/v1/embeddings", BODY, headers)
        answer = connection.getresponse()
        payload = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status}: {payload[:200]!r}")
        json.loads(payload)
        latencies.append(time.perf_counter() - started)
    connection.close()


def drive(port: int, clients: int, seconds: float) -> list[float]:
    """In a client process: ``clients`` closed-loop threads for ``seconds`` after a 1 s warm-up."""
    warm: list[float] = []
    _client(port, warm, time.perf_counter() + 1.0)
    per_thread: list[list[float]] = [[] for _ in range(clients)]
    stop_at = time.perf_counter() + seconds
    threads = [threading.Thread(target=_client, args=(port, per_thread[i], stop_at)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [latency for latencies in per_thread for latency in latencies]


async def measure(start, clients: int, seconds: float, pool) -> tuple[float, float]:
    """(requests a second, p50 seconds) of one variant under ``clients`` clients."""
    port, stop = await start()
    try:
        latencies = await asyncio.get_running_loop().run_in_executor(
            None, lambda: pool.apply(drive, (port, clients, seconds)))
    finally:
        await stop()
    return len(latencies) / seconds, statistics.median(latencies)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per measurement (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the variants (default 3)")
    args = parser.parse_args()
    throughput = {name: [] for name in VARIANTS}
    p50 = {name: [] for name in VARIANTS}
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        for round_ in range(args.rounds):
            for name, start in VARIANTS.items():
                rate, _ = await measure(start, 8, args.seconds, pool)
                _, median = await measure(start, 1, args.seconds, pool)
                throughput[name].append(rate)
                p50[name].append(median)
                print(f"round {round_ + 1} {name}: {rate:.0f} req/s at 8 clients, p50 {median * 1e6:.0f} us at 1",
                      flush=True)
    base = "aiohttp (same loop)"
    print(f"\n| framework | req/s, 8 clients (median of {args.rounds}) | vs aiohttp | p50, 1 client | vs aiohttp |")
    print("| --- | --- | --- | --- | --- |")
    ratios = {}
    for name in VARIANTS:
        rate, median = statistics.median(throughput[name]), statistics.median(p50[name])
        ratios[name] = rate / statistics.median(throughput[base])
        print(f"| {name} | {rate:.0f} | {ratios[name]:.2f}x | {median * 1e6:.0f} us | "
              f"{(median - statistics.median(p50[base])) * 1e6:+.0f} us |")
    print(f"RESULT fastapi_same_loop_vs_aiohttp={ratios['fastapi+uvicorn (same loop)']:.3f} "
          f"uvicorn_thread_vs_aiohttp={ratios['fastapi+uvicorn (own thread)']:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
