"""Session-wide compiled artifacts (real TVM builds for this CPU) and their references."""

from __future__ import annotations

from pathlib import Path

import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.model.presets import resolve_model
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine

from .reference import reference_model

MAX_BATCH = 8


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dietserve-cache")


def _artifact(model: str, cache_dir: Path) -> Path:
    return compile_artifact(CompileRequest(model=model, max_batch=MAX_BATCH), cache_dir)


@pytest.fixture(scope="session")
def minilm_artifact(cache_dir: Path) -> Path:
    return _artifact("default", cache_dir)


@pytest.fixture(scope="session")
def bert_base_artifact(cache_dir: Path) -> Path:
    return _artifact("bert-base", cache_dir)


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
