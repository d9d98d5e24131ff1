"""Checkpoints in the weight formats other than fp32 safetensors that published models use, each
written by sentence-transformers and embedding as sentence-transformers does with it:
- PyTorch's ``pytorch_model.bin`` only, the encoder's and a Dense module's (what releases of
  sentence-transformers before safetensors saved), fetched as a Hub id: the Hub's snapshot
  fetches the pickles only where there are no safetensors;
- safetensors in bf16, the dtype many recent checkpoints are published in."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dietserve.model.presets import default_model_folder

from .server_process import REPO_ROOT
from .test_hub_models import _cached

TEXTS = ["A man is eating food.", "Ein Mann isst Brot.", "The quick brown fox jumps over the lazy dog. " * 6]


def _sentence_model():
    """all-MiniLM-L6-v2 with a Dense module (384 -> 64, tanh) before Normalize, as LaBSE's head is."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    base = SentenceTransformer(str(default_model_folder()), device="cpu", local_files_only=True)
    torch.manual_seed(0)
    return SentenceTransformer(modules=[base[0], base[1], models.Dense(384, 64), models.Normalize()], device="cpu")


def _embed(model: str, cache_dir: Path, offline: bool = False) -> np.ndarray:
    environment = {**os.environ, **({"HF_HUB_OFFLINE": "1"} if offline else {})}
    done = subprocess.run([sys.executable, "-m", "dietserve", "embed", "--model", model, "--cache-dir", str(cache_dir),
                           "--json", *TEXTS], cwd=REPO_ROOT, env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return np.array(json.loads(done.stdout.strip().splitlines()[-1])["embeddings"])


@pytest.mark.slow
def test_a_hub_checkpoint_of_pytorch_pickles_only_embeds_as_sentence_transformers(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    model = _sentence_model()
    folder = tmp_path / "pickled"
    model.save(str(folder), safe_serialization=False)
    for path in folder.rglob("model.safetensors"):  # (transformers 5 writes safetensors whatever it is told)
        torch.save(load_file(str(path)), path.with_name("pytorch_model.bin"))
        path.unlink()
    assert (folder / "pytorch_model.bin").is_file() and (folder / "2_Dense" / "pytorch_model.bin").is_file()
    _cached(tmp_path / "cache", "acme/pickled", folder)
    ours = _embed("acme/pickled", tmp_path / "cache", offline=True)
    np.testing.assert_allclose(ours, model.encode(TEXTS), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_bf16_safetensors_checkpoint_embeds_as_its_weights_in_fp32_do(tmp_path: Path) -> None:
    import torch

    model = _sentence_model()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.bfloat16().float())  # the values the bf16 file holds, exactly
    copy.deepcopy(model).to(torch.bfloat16).save(str(tmp_path / "bf16"))
    stored = (tmp_path / "bf16" / "model.safetensors").read_bytes()
    header = json.loads(stored[8:8 + int.from_bytes(stored[:8], "little")])
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}
    np.testing.assert_allclose(_embed(str(tmp_path / "bf16"), tmp_path / "cache"), model.encode(TEXTS), rtol=0,
                               atol=1e-5)
