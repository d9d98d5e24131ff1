"""Session-wide compiled artifacts (real TVM builds for this CPU) and their references."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.model.presets import resolve_model
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
from dietserve.runtime.manifest import LAYOUT_PADDED

from .reference import reference_model

MAX_BATCH = 8

# Run in a fresh process, so that its resident memory grows by the load alone.
_RESIDENT_AFTER_LOAD = """
import json, sys
from pathlib import Path
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.memory import resident_bytes
before = resident_bytes()
loaded = load_artifact(Path(sys.argv[1]))
print(json.dumps({"grown": resident_bytes() - before, "weights": sum(p.numpy().nbytes for p in loaded.params)}))
"""


def resident_growth_of_load(artifact: Path) -> dict:
    """{"grown": bytes a fresh process's resident memory grew by loading ``artifact``,
    "weights": bytes of its parameters as loaded}."""
    completed = subprocess.run([sys.executable, "-c", _RESIDENT_AFTER_LOAD, str(artifact)],
                               capture_output=True, text=True, timeout=300, check=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dietserve-cache")


def _artifact(model: str, cache_dir: Path, layout: str | None = None) -> Path:
    return compile_artifact(CompileRequest(model=model, max_batch=MAX_BATCH, layout=layout), cache_dir)


@pytest.fixture(scope="session")
def minilm_artifact(cache_dir: Path) -> Path:
    return _artifact("default", cache_dir)


@pytest.fixture(scope="session")
def minilm_padded_engine(cache_dir: Path) -> Engine:
    """MiniLM in the padded layout: the graph CUDA builds, verified here on the CPU."""
    return Engine(load_artifact(_artifact("default", cache_dir, LAYOUT_PADDED)))


@pytest.fixture(scope="session")
def bert_base_artifact(cache_dir: Path) -> Path:
    return _artifact("bert-base", cache_dir)


@pytest.fixture(scope="session")
def reranker_artifact(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, Path]:
    """A one-label cross-encoder checkpoint (the folder names the model, 'reranker') and its artifact."""
    from .test_classification import classification_folder

    folder = classification_folder(tmp_path_factory.mktemp("reranker") / "reranker", 1)
    return folder, compile_artifact(CompileRequest(model=str(folder), max_batch=MAX_BATCH), cache_dir)


@pytest.fixture(scope="session")
def minilm_engine(minilm_artifact: Path) -> Engine:
    return Engine(load_artifact(minilm_artifact))


@pytest.fixture(scope="session")
def bert_base_engine(bert_base_artifact: Path) -> Engine:
    return Engine(load_artifact(bert_base_artifact))


@pytest.fixture(scope="session")
def minilm_reference():
    return reference_model(resolve_model("default", Path("unused")))


@pytest.fixture(scope="session")
def bert_base_reference(cache_dir: Path):
    return reference_model(resolve_model("bert-base", cache_dir))
