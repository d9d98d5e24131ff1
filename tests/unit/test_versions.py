"""The version store: whole versions only, numbering, the current pointer, rejection, rollback
and pruning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dietserve.runtime.manifest import PLANS_ANALYTIC, PLANS_DIR, PLANS_NONE, PLANS_TUNED, ArtifactError, Manifest
from dietserve.runtime.versions import VersionStore


def _artifact(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"tag": tag}))
    (folder / "model.so").write_text(tag)
    return folder


def test_publish_numbers_versions_and_ignores_unfinished_copies(tmp_path):
    store = VersionStore(tmp_path / "store")
    assert store.versions() == []
    with pytest.raises(ArtifactError, match="no usable version"):
        store.to_serve()
    assert store.publish(_artifact(tmp_path / "a", "a")) == 1
    assert store.publish(_artifact(tmp_path / "b", "b")) == 2
    (store.versions_dir / ".incoming-x").mkdir()  # a publisher that crashed mid-copy
    (store.versions_dir / "000007").mkdir()  # no manifest: not a version
    assert store.versions() == [1, 2]
    assert (store.path(2) / "model.so").read_text() == "b"
    assert store.to_serve() == 2 and store.current() is None
    with pytest.raises(ArtifactError, match="not an artifact"):
        store.publish(tmp_path / "missing")


def test_current_candidates_rejection_and_rollback(tmp_path):
    store = VersionStore(tmp_path / "store")
    for tag in "abcd":
        store.publish(_artifact(tmp_path / tag, tag))
    store.set_current(2)
    assert store.to_serve() == 2 and store.newer_candidate(2) == 4
    store.reject(4, "answers differ")
    assert store.rejected(4) == "answers differ\n" and store.newer_candidate(2) == 3
    assert store.rollback() == 1
    assert store.current() == 1 and store.to_serve() == 1
    assert all(store.rejected(v) for v in (2, 3, 4)) and store.newer_candidate(1) is None
    with pytest.raises(ArtifactError, match="nothing to roll back to"):
        store.rollback()


def test_pruning_keeps_the_newest_and_the_current(tmp_path):
    store = VersionStore(tmp_path / "store")
    store.publish(_artifact(tmp_path / "a", "a"))
    store.set_current(1)
    for tag in "bcdef":
        store.publish(_artifact(tmp_path / tag, tag), keep=3)
    assert store.versions() == [1, 4, 5, 6]


def _manifest_artifact(folder: Path, kernel_plans: str | None, with_plans: bool) -> Path:
    manifest = Manifest(model_name="m", model_config={}, normalize_embeddings=True, target={"kind": "llvm"},
                        tvm_version="0.27", cache_key="k", bounds={"batch": 1, "seq_len": 8}, parameters=[],
                        files={}, kernel_plans=kernel_plans)
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(manifest.to_json())
    if with_plans:
        (folder / PLANS_DIR).mkdir()
    return folder


@pytest.mark.parametrize(("kernel_plans", "with_plans", "tuned"), [
    (PLANS_TUNED, True, True), (PLANS_ANALYTIC, True, False), (PLANS_NONE, False, False),
    (None, True, True), (None, False, False)])  # None: a manifest from before it said
def test_a_version_is_tuned_only_when_its_plans_were_measured(tmp_path, kernel_plans, with_plans, tuned):
    store = VersionStore(tmp_path / "store")
    version = store.publish(_manifest_artifact(tmp_path / "a", kernel_plans, with_plans))
    assert store.tuned(version) is tuned
