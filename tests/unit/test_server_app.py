"""The server object's lifecycle, in process, over an engine stand-in: parts acquired in order,
released in reverse, and released too when a start fails half-way."""

from __future__ import annotations

import asyncio
import re
import socket
from types import SimpleNamespace

import numpy as np
import pytest

from dietserve.runtime.engine import EncoderOutput
from dietserve.server.app import Server
from dietserve.server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)


class _Engine:
    """What starting and stopping a server needs of an engine: bounds, execution, a manifest."""

    max_batch, max_seq_len, hidden_size = 4, 32, 2
    pool_bound = None

    def __init__(self):
        self.artifact = SimpleNamespace(manifest=SimpleNamespace(target={"kind": "llvm"}))

    def execute(self, ids, mask, types):
        hidden = np.zeros((*ids.shape, self.hidden_size), np.float32)
        return EncoderOutput(hidden, hidden.sum(axis=1))

    def bound_memory(self, limit_bytes: int) -> None:
        pass


def _config(**settings) -> ServerConfig:
    return ServerConfig(artifact=None, port=0, metrics_port=0, **settings)


def _ports(listening: str) -> list[int]:
    return [int(port) for port in re.findall(r"=[\d.]+:(\d+)", listening)]


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _run(server: Server, scenario) -> None:
    async def main():
        await scenario(server)

    asyncio.run(main())


def test_a_stop_request_drains_then_releases_every_port() -> None:
    lines: list[str] = []
    server = Server(_config(drain_seconds=0.01), "m", lambda: (_Engine(), None), lines.append)

    async def scenario(server: Server) -> None:
        await server.start()
        assert server.state.ready and set(server.state.models) == {"m", "m-text"}
        assert all(_accepts(port) for port in _ports(server.ports))
        server.request_stop()
        await server.wait()
        await server.stop()
        await server.stop()  # once only

    _run(server, scenario)
    assert [line.split(":")[0].split(" ")[0] for line in lines] == [
        "listening", "ready", "stopping", "stopping", "stopped;"]
    assert "serving 0.01 s more" in lines[2] and lines[-1] == "stopped; ModelInfer calls answered: none"
    assert not server.state.ready
    assert not any(_accepts(port) for port in _ports(lines[0]))


def test_a_stop_without_a_request_does_not_drain() -> None:
    lines: list[str] = []
    server = Server(_config(drain_seconds=30), "m", lambda: (_Engine(), None), lines.append)

    async def scenario(server: Server) -> None:
        await server.start()
        await server.stop(grace=0)

    _run(server, scenario)
    assert not any("more while load balancers notice" in line for line in lines)


def test_a_failed_load_releases_what_start_acquired_and_raises() -> None:
    lines: list[str] = []

    def load_model():
        raise RuntimeError("no such artifact")

    server = Server(_config(), "m", load_model, lines.append)

    async def scenario(server: Server) -> None:
        with pytest.raises(RuntimeError, match="no such artifact"):
            await server.start()

    _run(server, scenario)
    assert lines[0].startswith("listening") and lines[-1] == "stopped; ModelInfer calls answered: none"
    assert not any(line.startswith("ready") for line in lines)
    assert not any(_accepts(port) for port in _ports(lines[0]))
