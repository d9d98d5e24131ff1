"""The compile cache's pruning (``dietserve/compile/cache.py`` and ``python -m dietserve cache``):
entries made as ``compile_artifact`` makes them (a folder with a manifest), ages set by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dietserve.compile.cache import STALE_STAGING_SECONDS, cached_artifacts, prune, to_prune
from dietserve.runtime.manifest import MANIFEST_FILE

NOW = time.time()


def _entry(cache: Path, name: str, model: str, kind: str, age_s: float, size: int = 1000) -> Path:
    folder = cache / "artifacts" / name
    folder.mkdir(parents=True)
    (folder / MANIFEST_FILE).write_text(json.dumps({"model_name": model, "target": {"kind": kind}}))
    (folder / "model.so").write_bytes(b"\0" * size)
    os.utime(folder, (NOW - age_s, NOW - age_s))
    return folder


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    _entry(tmp_path, "bert-base-llvm-new", "bert-base", "llvm", 10)
    _entry(tmp_path, "bert-base-llvm-mid", "bert-base", "llvm", 3600)
    _entry(tmp_path, "bert-base-llvm-old", "bert-base", "llvm", 86400, size=5000)
    _entry(tmp_path, "bert-base-cuda-old", "bert-base", "cuda", 86400)
    _entry(tmp_path, "minilm-llvm-old", "all-MiniLM-L6-v2", "llvm", 86400 * 30)
    unknown = tmp_path / "artifacts" / "not-ours"
    unknown.mkdir()
    (unknown / "notes.txt").write_text("kept: no manifest")
    os.utime(unknown, (NOW - 86400 * 60, NOW - 86400 * 60))
    for name, age in ((".bert-base-llvm-crashed", STALE_STAGING_SECONDS + 60), (".bert-base-llvm-compiling", 60)):
        staging = tmp_path / "artifacts" / name
        staging.mkdir()
        (staging / "model.so").write_bytes(b"\0" * 300)
        os.utime(staging, (NOW - age, NOW - age))
    return tmp_path


def _names(folder: Path) -> set[str]:
    return {p.name for p in (folder / "artifacts").iterdir()}


def test_entries_are_listed_most_recently_used_first(cache: Path) -> None:
    entries = cached_artifacts(cache)
    assert [e.path.name for e in entries][:2] == ["bert-base-llvm-new", "bert-base-llvm-mid"]
    assert not any(e.path.name.startswith(".") for e in entries)
    assert {e.path.name: e.readable for e in entries}["not-ours"] is False


def test_prune_keeps_the_most_recent_of_each_model_and_kind(cache: Path) -> None:
    assert {e.path.name for e in to_prune(cached_artifacts(cache), keep=1)} == {"bert-base-llvm-mid",
                                                                               "bert-base-llvm-old"}
    removed, freed = prune(cache, to_prune(cached_artifacts(cache), keep=2))
    assert {p.name for p in removed} == {"bert-base-llvm-old", ".bert-base-llvm-crashed"}
    assert freed >= 5000 + 300
    # Another target kind, another model, a folder without a manifest and a compile in
    # progress are all still there.
    assert _names(cache) == {"bert-base-llvm-new", "bert-base-llvm-mid", "bert-base-cuda-old", "minilm-llvm-old",
                             "not-ours", ".bert-base-llvm-compiling"}


def test_keep_below_one_is_refused(cache: Path) -> None:
    with pytest.raises(ValueError, match="--keep"):
        to_prune(cached_artifacts(cache), keep=0)


def test_the_command_lists_then_prunes(cache: Path) -> None:
    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dietserve", "cache", "--cache-dir", str(cache), *flags],
                              capture_output=True, text=True, timeout=120)

    listed = run("--keep", "1")
    assert listed.returncode == 0, listed.stderr
    assert "--prune would delete 2 of them" in listed.stdout
    assert "bert-base-llvm-old" in listed.stdout and "bert-base-llvm-old" in _names(cache)
    pruned = run("--prune", "--keep", "1")
    assert pruned.returncode == 0, pruned.stderr
    assert "deleted 3 folder(s)" in pruned.stdout
    assert not {"bert-base-llvm-mid", "bert-base-llvm-old", ".bert-base-llvm-crashed"} & _names(cache)
    refused = run("--keep", "0")
    assert refused.returncode == 2 and "--keep must be at least 1" in refused.stderr
