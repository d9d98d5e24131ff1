"""Hugging Face checkpoint folder -> parameters in the layout of our Relax BERT."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from .bert import BertModel, PoolingOptions, checkpoint_parts, transposed_weight_names
from .config import BertConfig, ModelConfigError
from .side_by_side import side_by_side

# Prefixes under which task heads (BertForMaskedLM, ...) nest the encoder.
_ENCODER_PREFIXES = ("bert.", "model.")
# Pre-2019 checkpoints name LayerNorm parameters gamma/beta.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}


class CheckpointError(ValueError):
    """A checkpoint folder is missing files or tensors, or their shapes do not fit the config."""


@dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face BERT folder: config, weights file, optional sentence-transformers pooling."""

    folder: Path
    config: BertConfig
    pooling: PoolingOptions

    @property
    def weights_file(self) -> Path:
        return self.folder / "model.safetensors"

    @classmethod
    def open(cls, folder: Path) -> Checkpoint:
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"model folder {folder} does not exist")
        try:
            config = BertConfig.from_file(folder / "config.json")
        except ModelConfigError as err:
            raise CheckpointError(str(err)) from err
        if not (folder / "model.safetensors").is_file():
            raise CheckpointError(f"{folder} has no model.safetensors (pytorch_model.bin is not read)")
        return cls(folder, config, read_pooling_options(folder))


def read_pooling_options(folder: Path) -> PoolingOptions:
    """Sentence-transformers checkpoints list a Normalize module in modules.json."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingOptions()
    modules = json.loads(modules_file.read_text())
    kinds = {module.get("type", "") for module in modules}
    return PoolingOptions(normalize="sentence_transformers.models.Normalize" in kinds)


def canonical_name(name: str) -> str:
    for prefix in _ENCODER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for old, new in _LEGACY_SUFFIXES.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
    return name


def load_parameters(
    checkpoint: Checkpoint, model: BertModel, expected: list[tuple[str, tuple[int, ...]]]
) -> dict[str, np.ndarray]:
    """Read the checkpoint's tensors, rename, transpose linear weights, concatenate the ones a
    layer computes side by side (the query, key and value projections) and check every shape."""
    raw = {canonical_name(k): v for k, v in load_file(str(checkpoint.weights_file)).items()}
    transposed = transposed_weight_names(model)
    sources = checkpoint_parts(model)
    params: dict[str, np.ndarray] = {}
    for name, shape in expected:
        for part in sources[name]:
            if part not in raw:
                raise CheckpointError(f"{checkpoint.weights_file} has no tensor {part!r}")
        try:
            tensor = side_by_side([raw[part] for part in sources[name]], name in transposed)
        except ValueError as err:
            raise CheckpointError(f"{name!r} from {list(sources[name])}: {err}") from None
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {shape}"
            )
        params[name] = tensor
    return params
