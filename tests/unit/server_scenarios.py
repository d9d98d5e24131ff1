"""Runs a Server over an engine stand-in through one scenario and prints, as JSON, what it said
and which of its ports accepted connections during and after. A separate process: the server's
protocol messages share the ``inference`` protobuf package with tritonclient's, which other
tests import, and one process cannot register both.

    python -m tests.unit.server_scenarios {requested-stop,unrequested-stop,failed-load,two-models}
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
from types import SimpleNamespace

import numpy as np

from dietserve.runtime.engine import EncoderOutput
from dietserve.server.app import Server
from dietserve.server.config import ServerConfig
from dietserve.server.served_artifact import ModelSource


class Engine:
    """What starting and stopping a server needs of an engine: bounds, execution, a manifest."""

    max_batch, max_seq_len, hidden_size = 4, 32, 2
    packed = False
    pool_bound = None

    def __init__(self):
        self.artifact = SimpleNamespace(manifest=SimpleNamespace(target={"kind": "llvm"}))

    def execute(self, ids, mask, types):
        hidden = np.zeros((*ids.shape, self.hidden_size), np.float32)
        return EncoderOutput(hidden, hidden.sum(axis=1))

    def bound_memory(self, limit_bytes: int) -> None:
        pass


class PackedEngine(Engine):
    packed = True


def load_engine():
    return Engine(), None


def load_packed_engine():
    return PackedEngine(), None


def fail_to_load():
    raise RuntimeError("no such artifact")


def accepting(listening: str) -> list[bool]:
    """Whether each port of a ``listening ...`` line accepts a connection."""
    result = []
    for port in re.findall(r"=[\d.]+:(\d+)", listening):
        with socket.socket() as probe:
            result.append(probe.connect_ex(("127.0.0.1", int(port))) == 0)
    return result


async def run(scenario: str) -> dict:
    lines: list[str] = []
    config = ServerConfig(artifact=None, port=0, metrics_port=0, http_port=0,
                          drain_seconds=0.01 if scenario == "requested-stop" else 30)
    sources = [ModelSource("m", fail_to_load if scenario == "failed-load" else load_engine)]
    if scenario == "two-models":
        sources.append(ModelSource("n", load_packed_engine))
    server = Server(config, sources, lines.append)
    report: dict = {"lines": lines}
    try:
        await server.start()
    except RuntimeError as err:
        report["error"] = str(err)
    else:
        report.update(ready=server.state.ready, models=sorted(server.state.models),
                      accepting_while_serving=accepting(server.ports))
        if scenario == "requested-stop":
            server.request_stop()
            await server.wait()
            await server.stop()
        else:
            await server.stop(grace=0)
        await server.stop()  # a second stop does nothing
    report.update(ready_after=server.state.ready, accepting_after=accepting(lines[0]))
    return report


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run(sys.argv[1]))))
