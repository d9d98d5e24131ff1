"""A checkpoint's tensors as numpy arrays, from the files Hugging Face folders hold them in:
``model.safetensors`` (any float dtype, bf16 included, which numpy cannot name), PyTorch's
``pytorch_model.bin`` (read without PyTorch: the server does not install it), or either one
sharded under its ``.index.json``. Safetensors are preferred where a folder has both.

A ``.bin`` file is a pickle, and a pickle can run code as it loads. Only what a saved state
dict is made of is rebuilt (storages, tensors over them, an OrderedDict); a pickle asking for
anything else is refused before anything of it runs."""

from __future__ import annotations

import json
import math
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAFETENSORS = "model.safetensors"
PYTORCH = "pytorch_model.bin"
SHARD_INDEX = ".index.json"  # after either name: the shards' index
# Weights in formats nothing here reads, named in the error so the user knows what they have.
_UNREAD = ("tf_model.h5", "flax_model.msgpack", "model.onnx", "onnx/model.onnx", "openvino/openvino_model.xml")

_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bf16", "I64": np.int64,
                       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
# PyTorch's typed storages, as a pickle names them (``torch.FloatStorage``), and their elements.
_STORAGES = {"DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
             "BFloat16Storage": "bf16", "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
             "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


class WeightFileError(ValueError):
    """A weights file is missing, unreadable, or holds more than tensors."""


def find_weight_files(folder: Path) -> list[Path]:
    """The files holding ``folder``'s tensors: its safetensors, else its PyTorch pickle, either
    whole or the shards its index names."""
    for name in (SAFETENSORS, PYTORCH):
        if (folder / name).is_file():
            return [folder / name]
        index = folder / (name + SHARD_INDEX)
        if index.is_file():
            return _shards(index)
    found = [name for name in _UNREAD if (folder / name).is_file()]
    also = f"; it has {', '.join(found)}, which dietserve does not read" if found else ""
    raise WeightFileError(f"{folder} has no {SAFETENSORS} or {PYTORCH} (nor a sharded index of either){also}")


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise WeightFileError(f"{index} is not a readable shard index: {err!r}") from None
    shards = [index.parent / name for name in dict.fromkeys(weight_map.values())]
    missing = [str(path.name) for path in shards if not path.is_file()]
    if missing:
        raise WeightFileError(f"{index} names shards that are missing: {', '.join(missing)}")
    return shards


def read_tensors(paths: list[Path]) -> dict[str, np.ndarray]:
    """Every tensor of ``paths`` by name; bf16 ones widened to float32 (exactly)."""
    tensors: dict[str, np.ndarray] = {}
    for path in paths:
        tensors.update(_read_pytorch(path) if path.name.endswith(".bin") else _read_safetensors(path))
    return tensors


def _widened(raw: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) as the float32 values they round from: the upper half of each."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The format is an 8-byte little-endian header length, a JSON header of each tensor's dtype,
    shape and byte range, then the bytes."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        size = int(data[:8].view("<u8")[0])
        header = json.loads(bytes(data[8:8 + size]))
        return {name: _safetensor(data, 8 + size, name, entry) for name, entry in header.items()
                if name != "__metadata__"}
    except (ValueError, IndexError, KeyError, TypeError) as err:
        raise WeightFileError(f"{path} is not a readable safetensors file: {err!r}") from None


def _safetensor(data: np.ndarray, start: int, name: str, entry: dict) -> np.ndarray:
    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"tensor {name!r} has dtype {entry['dtype']}, which is not read")
    begin, end = (start + offset for offset in entry["data_offsets"])
    raw = data[begin:end].view(np.uint16 if dtype == "bf16" else dtype).reshape(entry["shape"])
    return _widened(raw) if dtype == "bf16" else np.array(raw)


def _read_pytorch(path: Path) -> dict[str, np.ndarray]:
    """``torch.save``'s zip format (PyTorch 1.6 and later): ``<root>/data.pkl`` pickles the state
    dict, each storage's bytes sit in ``<root>/data/<key>``."""
    if not zipfile.is_zipfile(path):
        raise WeightFileError(f"{path} is not a zip archive: saved by PyTorch before 1.6, a format not read "
                              "(save it again with safetensors, as transformers' save_pretrained does), or damaged")
    with zipfile.ZipFile(path) as archive:
        pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise WeightFileError(f"{path} is a zip archive but not one torch.save wrote (no data.pkl)")
        root = pickles[0][: -len("data.pkl")]
        if root + "byteorder" in archive.namelist() and archive.read(root + "byteorder").strip() != b"little":
            raise WeightFileError(f"{path} was saved on a big-endian machine, which is not read")
        with archive.open(pickles[0]) as stream:
            try:
                state = _StateDictUnpickler(stream, archive, root, path).load()
            except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as err:
                if isinstance(err, WeightFileError):
                    raise
                raise WeightFileError(f"{path} is not a readable state dict: {err!r}") from None
    if not isinstance(state, dict):
        raise WeightFileError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    return {name: tensor for name, tensor in state.items() if isinstance(tensor, np.ndarray)}


@dataclass(frozen=True)
class _Storage:
    """A storage's elements; bf16 ones as their bit patterns (uint16)."""

    elements: np.ndarray
    bf16: bool


def _rebuild_tensor(storage: _Storage, offset: int, size, stride, *_ignored) -> np.ndarray:
    """A tensor over its storage: ``size`` elements from ``offset``, ``stride`` apart per axis."""
    size, stride, elements = tuple(size), tuple(stride), storage.elements
    if any(n < 0 for n in size) or any(s < 0 for s in stride) or len(size) != len(stride):
        raise WeightFileError(f"a tensor of size {size} and stride {stride} is not a view of its storage")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else offset - 1
    if offset < 0 or last >= len(elements) or math.prod(size) > len(elements):
        raise WeightFileError(f"a tensor of size {size} at offset {offset} runs past its storage ({len(elements)})")
    view = np.lib.stride_tricks.as_strided(elements[offset:], size, [s * elements.itemsize for s in stride])
    return _widened(view) if storage.bf16 else np.array(view)


class _StateDictUnpickler(pickle.Unpickler):
    """Rebuilds tensors and nothing else (``find_class`` is the gate)."""

    def __init__(self, stream, archive: zipfile.ZipFile, root: str, path: Path):
        super().__init__(stream)
        self.archive, self.root, self.path = archive, root, path
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda tensor, *_ignored: tensor
        if module == "torch" and name in _STORAGES:
            return name
        raise WeightFileError(f"{self.path} asks to load {module}.{name}, which a state dict of tensors "
                              "has no need of; refusing to run it (only tensors are read)")

    def persistent_load(self, pid):
        """``('storage', <storage name>, key, location, numel)``: the elements under ``data/<key>``."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _STORAGES):
            raise WeightFileError(f"{self.path} refers to {pid!r}, which is not a storage of tensors")
        _kind, storage, key, _location, count = pid
        if key not in self.storages:
            dtype = _STORAGES[storage]
            raw = np.frombuffer(self.archive.read(f"{self.root}data/{key}"),
                                np.uint16 if dtype == "bf16" else dtype)
            if len(raw) < count:
                raise WeightFileError(f"{self.path}: storage {key} holds {len(raw)} elements, not {count}")
            self.storages[key] = _Storage(raw, dtype == "bf16")
        return self.storages[key]
