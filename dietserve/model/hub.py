"""Checkpoints named by their Hugging Face Hub id (``BAAI/bge-small-en-v1.5``, ``org/name@revision``),
fetched with huggingface_hub into dietserve's cache: the files a build reads, nothing else (no
ONNX or TensorFlow weights; PyTorch's only where there are no safetensors). A snapshot already
fetched is used when the Hub cannot be reached."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .tokenizer import TOKENIZER_FILES
from .weight_files import PYTORCH, SAFETENSORS, SHARD_INDEX

HUB_DIR = "hub"  # under the cache directory, in huggingface_hub's own layout
# What a build reads: the config and weights, the tokenizer, sentence-transformers' recipe and its
# modules' folders (1_Pooling/config.json, 2_Dense/model.safetensors, ...).
_BUILD_FILES = ["config.json", SAFETENSORS, SAFETENSORS + SHARD_INDEX, "model-*-of-*.safetensors", "modules.json",
                *TOKENIZER_FILES, "*/config.json", f"*/{SAFETENSORS}"]
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


class HubError(ValueError):
    """A Hub checkpoint could not be fetched, nor found already fetched."""


def hub_id(name: str) -> tuple[str, str | None] | None:
    """``(repo, revision)`` if ``name`` reads as a Hub id (``org/name`` or ``org/name@revision``)
    and no local path of that name exists; else None."""
    match = _HUB_ID.match(name)
    if match is None or Path(name).exists():
        return None
    return match["repo"], match["revision"]


def display_name(name: str) -> str | None:
    """What the server calls a Hub checkpoint: its name within its organisation (a model name
    with no slash, as the v2 URLs need); None for a name that is no Hub id."""
    parsed = hub_id(name)
    return parsed[0].split("/", 1)[1] if parsed else None


def fetch(name: str, cache_dir: Path) -> Path:
    """The folder of ``name``'s snapshot, fetched now or earlier (``hub_id`` must accept ``name``);
    PyTorch's weights are fetched only for the parts that have no safetensors."""
    repo, revision = hub_id(name)
    folder = _snapshot(name, repo, revision, cache_dir, _BUILD_FILES)
    pickled = _pickled_weights(folder)
    if pickled:
        folder = _snapshot(name, repo, revision, cache_dir, pickled)
    return folder


def _snapshot(name: str, repo: str, revision: str | None, cache_dir: Path, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=Path(cache_dir) / HUB_DIR,
                                      allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise HubError(f"{repo} is not a model on the Hugging Face Hub (or it needs a token: set HF_TOKEN); "
                       "pass a local folder otherwise") from None
    except LocalEntryNotFoundError as err:
        raise HubError(f"{name}: the Hugging Face Hub cannot be reached and no snapshot was fetched before "
                       f"under {Path(cache_dir) / HUB_DIR} ({err}); pass a local folder instead") from None
    except HfHubHTTPError as err:
        raise HubError(f"{name}: the Hugging Face Hub answered {err}") from None


def _pickled_weights(folder: Path) -> list[str]:
    """The patterns of the PyTorch weights a snapshot needs: the encoder's where it has no
    safetensors, and each sentence-transformers Dense module's likewise (older releases of
    sentence-transformers saved those as pytorch_model.bin)."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):  # none, or one the checkpoint's reader will name
        modules = []
    parts = ["", *(f"{m['path']}/" for m in modules if isinstance(m, dict) and m.get("path")
                   and str(m.get("type", "")).endswith("Dense"))]
    needed = [part for part in parts if not ((folder / part / SAFETENSORS).is_file()
                                             or (folder / part / (SAFETENSORS + SHARD_INDEX)).is_file())]
    return [f"{part}{name}" for part in needed for name in (PYTORCH, PYTORCH + SHARD_INDEX, "pytorch_model-*.bin")]
