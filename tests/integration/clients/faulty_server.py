"""A real dietserve server with two injected faults, to show what unexpected errors look like
from outside. Fault injection is the only way to provoke them: validated requests do not fail
inside the VM, and recording a batch's metrics does not fail either.

- The engine raises on one token id (the client must get INTERNAL with a reference).
- Recording every batch's metrics raises (the answers must still go out, the server stay up).

    python faulty_server.py ARTIFACT FAULT_TOKEN_ID
"""

import asyncio
import sys
from pathlib import Path

from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.embedder import artifact_tokenizer
from dietserve.runtime.engine import Engine
from dietserve.server.app import Server
from dietserve.server.config import ServerConfig
from dietserve.server.served_artifact import ModelSource


class FaultyServer(Server):
    def batch_recorder(self, served):
        def record(run):
            raise RuntimeError("injected fault: recording the batch failed")

        return record


def say(message: str) -> None:
    print(f"[dietserve] {message}", file=sys.stderr, flush=True)


async def serve(server: Server) -> int:
    server.stop_on_signals()
    return await server.run()


def main(artifact: Path, fault_token: int) -> int:
    config = ServerConfig(artifact=artifact, port=0, metrics_port=0, http_port=0)

    def load_model():
        engine = Engine(load_artifact(artifact))
        execute = engine.execute

        def faulty(ids, mask, types):
            if (ids == fault_token).any():
                raise RuntimeError("injected fault: secret internal detail")
            return execute(ids, mask, types)

        engine.execute = faulty
        return engine, artifact_tokenizer(engine)

    return asyncio.run(serve(FaultyServer(config, [ModelSource("minilm", load_model)], say)))


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
