"""The floor of the server's design on this machine: the median latency of an empty gRPC aio
handler beside one that only hands the call to a worker thread and back (what keeping the VM
call off the event loop costs at least), each in a separate server process on loopback.

    python tests/benchmarks/grpc_floor.py [--blocks 10] [--per-block 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

POOL = ThreadPoolExecutor(1)


async def empty(request, context):
    return b""


async def hop(request, context):
    await asyncio.get_running_loop().run_in_executor(POOL, lambda: None)
    return b""


async def serve() -> None:
    server = grpc.aio.server()
    handlers = {"Empty": grpc.unary_unary_rpc_method_handler(empty), "Hop": grpc.unary_unary_rpc_method_handler(hop)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", handlers),))
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        asyncio.run(serve())
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--per-block", type=int, default=200)
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        times: dict[str, list[float]] = {"Empty": [], "Hop": []}
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = {name: channel.unary_unary(f"/floor.Floor/{name}") for name in times}
            for _ in range(args.blocks):  # interleaved blocks
                for name, call in calls.items():
                    for _ in range(args.per_block):
                        started = time.perf_counter()
                        call(b"x", timeout=10)
                        times[name].append(time.perf_counter() - started)
    finally:
        server.kill()
    empty_us, hop_us = (statistics.median(times[name]) * 1e6 for name in ("Empty", "Hop"))
    print(f"empty handler {empty_us:.0f} us, with a thread hop {hop_us:.0f} us")
    print(f"RESULT empty_us={empty_us:.0f} hop_us={hop_us:.0f} hop_cost_us={hop_us - empty_us:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
