"""The weights reader against the library that wrote each file: PyTorch's ``torch.save`` (its zip
format, every dtype a checkpoint uses, views sharing a storage) and safetensors (bf16 included),
whole or sharded as transformers shards them; pickles that ask for more than tensors are refused
before anything of theirs runs, and the reader works where PyTorch cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dietserve.model.weight_files import PYTORCH, SAFETENSORS, WeightFileError, find_weight_files, read_tensors

REPO_ROOT = Path(__file__).resolve().parents[2]


def _state_dict():
    """Tensors of each dtype a checkpoint holds, and views with offsets and strides over one storage."""
    import torch

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=generator)
    return {
        "float32": torch.randn(3, 5, generator=generator),
        "float16": torch.randn(4, 7, generator=generator).half(),
        "bfloat16": torch.randn(9, generator=generator).bfloat16(),
        "float64": torch.randn(2, 2, generator=generator).double(),
        "int64": torch.arange(12).reshape(3, 4),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "base": base,
        "transposed": base.t(),  # the same storage, strides swapped
        "rows_2_to_4": base[2:4],  # an offset into it
        "every_other_column": base[:, ::2],
    }


def _as_numpy(tensor) -> np.ndarray:
    import torch

    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _assert_same(ours: dict, expected: dict) -> None:
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        want = _as_numpy(tensor)
        assert ours[name].shape == want.shape and ours[name].dtype == (np.float32 if "bfloat16" in name
                                                                       else want.dtype), name
        np.testing.assert_array_equal(ours[name], want, err_msg=name)


def test_torch_save_is_read_as_torch_wrote_it(tmp_path: Path) -> None:
    import torch

    state = _state_dict()
    torch.save(state, tmp_path / PYTORCH)
    _assert_same(read_tensors([tmp_path / PYTORCH]), state)


def test_safetensors_of_every_dtype_is_read_bf16_widened_exactly(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = {name: tensor.contiguous().clone() for name, tensor in _state_dict().items()}
    save_file(state, str(tmp_path / SAFETENSORS), metadata={"format": "pt"})
    _assert_same(read_tensors([tmp_path / SAFETENSORS]), state)


def _pytorch_shards(model, folder: Path, count: int) -> None:
    """``model``'s state dict in ``count`` torch.save shards with their index, as transformers 4
    wrote them (transformers 5 writes safetensors only)."""
    import torch

    names = list(model.state_dict())
    weight_map = {}
    for index in range(count):
        shard = f"pytorch_model-{index + 1:05d}-of-{count:05d}.bin"
        part = {name: model.state_dict()[name] for name in names[index::count]}
        torch.save(part, folder / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (folder / (PYTORCH + ".index.json")).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch"])
def test_a_sharded_checkpoint_is_read_from_its_index(tmp_path: Path, safe: bool) -> None:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64))
    if safe:
        model.save_pretrained(tmp_path, max_shard_size="40KB")
    else:
        _pytorch_shards(model, tmp_path, 3)
    files = find_weight_files(tmp_path)
    assert len(files) > 2 and all(path.parent == tmp_path and path.suffix == (".safetensors" if safe else ".bin")
                                  for path in files)
    ours = read_tensors(files)
    expected = model.state_dict()
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        np.testing.assert_array_equal(ours[name], tensor.numpy(), err_msg=name)


def test_safetensors_are_preferred_and_missing_weights_are_named(tmp_path: Path) -> None:
    (tmp_path / PYTORCH).write_bytes(b"")
    assert find_weight_files(tmp_path) == [tmp_path / PYTORCH]
    (tmp_path / SAFETENSORS).write_bytes(b"")
    assert find_weight_files(tmp_path) == [tmp_path / SAFETENSORS]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "tf_model.h5").write_bytes(b"")
    with pytest.raises(WeightFileError, match=r"has no model.safetensors or pytorch_model.bin .*tf_model.h5"):
        find_weight_files(empty)
    (empty / (SAFETENSORS + ".index.json")).write_text(json.dumps({"weight_map": {"a": "model-1-of-2.safetensors"}}))
    with pytest.raises(WeightFileError, match="names shards that are missing: model-1-of-2.safetensors"):
        find_weight_files(empty)


class _RunsACommand:
    """What a malicious checkpoint pickles: calling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_pickle_asking_for_more_than_tensors_is_refused_unrun(tmp_path: Path) -> None:
    import torch

    marker = tmp_path / "ran"
    torch.save({"weight": torch.ones(2), "payload": _RunsACommand(marker)}, tmp_path / PYTORCH)
    with pytest.raises(WeightFileError, match=r"asks to load (posix|os)\.system.*refusing to run it"):
        read_tensors([tmp_path / PYTORCH])
    assert not marker.exists()


def test_the_format_before_pytorch_1_6_is_refused_by_name(tmp_path: Path) -> None:
    import torch

    torch.save({"weight": torch.ones(2)}, tmp_path / PYTORCH, _use_new_zipfile_serialization=False)
    with pytest.raises(WeightFileError, match="not a zip archive: saved by PyTorch before 1.6"):
        read_tensors([tmp_path / PYTORCH])


def test_the_reader_needs_no_pytorch(tmp_path: Path) -> None:
    import torch

    torch.save({"weight": torch.arange(6.0).reshape(2, 3).bfloat16()}, tmp_path / PYTORCH)
    script = ("import sys; sys.modules['torch'] = None  # import torch now fails\n"
              "from pathlib import Path; from dietserve.model.weight_files import read_tensors\n"
              f"print(read_tensors([Path({str(tmp_path / PYTORCH)!r})])['weight'].tolist())")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]"


def test_a_damaged_or_oversized_pickle_is_named_not_a_traceback(tmp_path: Path) -> None:
    """A storage missing from the archive, and a tensor claiming more elements than its storage
    holds (a stride of 0 would let it ask for any size), are refused with the file's name."""
    import zipfile

    import torch

    torch.save({"weight": torch.ones(4)}, tmp_path / PYTORCH)
    with zipfile.ZipFile(tmp_path / PYTORCH) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    damaged = tmp_path / "damaged" / PYTORCH
    damaged.parent.mkdir()
    with zipfile.ZipFile(damaged, "w") as archive:
        for name, data in entries.items():
            if "/data/" not in name:
                archive.writestr(name, data)
    with pytest.raises(WeightFileError, match="damaged/pytorch_model.bin is not a readable state dict"):
        read_tensors([damaged])
    oversized = tmp_path / "oversized" / PYTORCH
    oversized.parent.mkdir()
    torch.save({"weight": torch.ones(1).expand(1000)}, oversized)
    with pytest.raises(WeightFileError, match=r"size \(1000,\) at offset 0 runs past its storage \(1\)"):
        read_tensors([oversized])
