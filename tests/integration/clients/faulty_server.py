"""A real dietserve server whose engine fails on one token id, to show what an unexpected error
looks like to a client. Fault injection is the only way to provoke one: validated requests do not
fail inside the VM.

    python faulty_server.py ARTIFACT FAULT_TOKEN_ID
"""

import asyncio
import sys
from pathlib import Path

from dietserve.model.tokenizer import TextTokenizer
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
from dietserve.server.app import serve
from dietserve.server.config import ServerConfig
from dietserve.server.model import ServedModel


def main(artifact: Path, fault_token: int) -> int:
    config = ServerConfig(artifact=artifact, port=0, metrics_port=0)

    def load_model() -> ServedModel:
        engine = Engine(load_artifact(artifact))
        execute = engine.execute

        def faulty(ids, mask, types):
            if (ids == fault_token).any():
                raise RuntimeError("injected fault: secret internal detail")
            return execute(ids, mask, types)

        engine.execute = faulty
        return ServedModel("minilm", engine, TextTokenizer.from_folder(artifact, engine.max_seq_len))

    return asyncio.run(serve(config, "minilm", load_model, lambda m: print(f"[dietserve] {m}", file=sys.stderr,
                                                                          flush=True)))


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
