"""A checkpoint named by its Hugging Face Hub id, as TEI's ``--model-id`` names one. The Hub cannot
be reached from the test machines, so huggingface_hub's cache is laid out as a download leaves it
(``refs/main`` naming a snapshot folder) and the real command resolves the id through
huggingface_hub, offline; the download itself is huggingface_hub's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dietserve.model.hub import HUB_DIR, display_name, hub_id
from dietserve.model.presets import default_model_folder

from .server_process import REPO_ROOT, ServerProcess

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def _cached(cache_dir: Path, repo: str, folder: Path) -> None:
    """``folder`` as huggingface_hub's cache under ``cache_dir`` holds a download of ``repo``."""
    root = cache_dir / HUB_DIR / f"models--{repo.replace('/', '--')}"
    if not root.exists():
        shutil.copytree(folder, root / "snapshots" / SNAPSHOT)
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(SNAPSHOT)


def _dietserve(*args: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "dietserve", *args], cwd=REPO_ROOT, env=environment,
                          capture_output=True, text=True, timeout=600)


def test_a_hub_id_embeds_as_sentence_transformers_does(cache_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    repo, texts = "sentence-transformers/all-MiniLM-L6-v2", ["A man is eating food.", "Ein Mann isst Brot."]
    _cached(cache_dir, repo, default_model_folder())
    done = _dietserve("embed", "--model", repo, "--cache-dir", str(cache_dir), "--json", *texts)
    assert done.returncode == 0, done.stderr
    ours = np.array(json.loads(done.stdout.strip().splitlines()[-1])["embeddings"])
    expected = SentenceTransformer(str(default_model_folder()), device="cpu", local_files_only=True).encode(texts)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5)
    assert f"models--sentence-transformers--all-MiniLM-L6-v2/snapshots/{SNAPSHOT}" in done.stderr


@pytest.mark.slow
def test_a_server_of_a_hub_id_answers_to_the_id_and_to_its_name(cache_dir: Path) -> None:
    """``serve --model org/name``: OpenAI's client names the model by its Hub id, as it would
    against TEI or vLLM; the v2 routes by the name within the organisation (no slash in a URL)."""
    import requests
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    repo, texts = "sentence-transformers/all-MiniLM-L6-v2", ["A man is eating food.", "Ein Mann isst Brot."]
    _cached(cache_dir, repo, default_model_folder())
    server = ServerProcess(None, "--model", repo, "--cache-dir", str(cache_dir), "--no-auto-tune", model_name=None,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        client = OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused")
        expected = SentenceTransformer(str(default_model_folder()), device="cpu", local_files_only=True).encode(texts)
        for name in (repo, "all-MiniLM-L6-v2"):
            answer = client.embeddings.create(model=name, input=texts, encoding_format="float")
            np.testing.assert_allclose([row.embedding for row in answer.data], expected, rtol=0, atol=1e-5)
        ready = requests.get(f"http://{server.http_url}/v2/models/all-MiniLM-L6-v2/ready", timeout=10)
        assert ready.status_code == 200
        unknown = requests.post(f"http://{server.http_url}/v1/embeddings", json={"model": "acme/other", "input": "hi"},
                                timeout=10)
        assert unknown.status_code == 404 and "unknown model 'acme/other'" in unknown.text
    finally:
        server.stop()


def test_a_hub_id_neither_reachable_nor_fetched_is_refused_naming_it(tmp_path: Path) -> None:
    done = _dietserve("compile", "--model", "acme/not-fetched", "--cache-dir", str(tmp_path))
    assert done.returncode != 0
    assert "acme/not-fetched: the Hugging Face Hub cannot be reached and no snapshot was fetched before" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_hub_checkpoint_without_weights_is_refused_naming_what_it_lacks(tmp_path: Path) -> None:
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(default_model_folder() / name, no_weights / name)
    _cached(tmp_path / "cache", "acme/no-weights", no_weights)
    done = _dietserve("compile", "--model", "acme/no-weights", "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "has no model.safetensors or pytorch_model.bin" in done.stderr


@pytest.mark.parametrize(("name", "expected", "served_as"), [
    ("BAAI/bge-small-en-v1.5", ("BAAI/bge-small-en-v1.5", None), "bge-small-en-v1.5"),
    ("intfloat/multilingual-e5-small@refs/pr/3", ("intfloat/multilingual-e5-small", "refs/pr/3"),
     "multilingual-e5-small"),
    ("default", None, None), ("/abs/folder", None, None), ("./org/name", None, None), ("a/b/c", None, None),
])
def test_what_reads_as_a_hub_id(name: str, expected, served_as) -> None:
    assert hub_id(name) == expected and display_name(name) == served_as


def test_an_existing_folder_is_not_a_hub_id(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_id("org/name") is None


def test_pytorch_weights_are_fetched_only_where_safetensors_are_missing(tmp_path: Path) -> None:
    from dietserve.model.hub import _pickled_weights

    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    for part in ("", "2_Dense"):
        (tmp_path / part).mkdir(exist_ok=True)
        (tmp_path / part / "model.safetensors").write_bytes(b"")
    assert _pickled_weights(tmp_path) == ["3_Dense/pytorch_model.bin", "3_Dense/pytorch_model.bin.index.json",
                                          "3_Dense/pytorch_model-*.bin"]
    (tmp_path / "model.safetensors").unlink()
    assert _pickled_weights(tmp_path)[:3] == ["pytorch_model.bin", "pytorch_model.bin.index.json",
                                              "pytorch_model-*.bin"]
