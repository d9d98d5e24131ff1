"""Artifacts: manifest contents, cache reuse, integrity and machine checks, use across processes."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tvm

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.embedder import Embedder
from dietserve.runtime.engine import Engine
from dietserve.runtime.manifest import LIBRARY_FILE, MANIFEST_FILE, PARAMS_FILE, ArtifactError, Manifest, sha256_file

from .conftest import MAX_BATCH, resident_growth_of_load


def test_manifest_records_model_target_bounds_and_hashes(minilm_artifact: Path) -> None:
    manifest = Manifest.read(minilm_artifact)
    assert manifest.target["kind"] == "llvm" and manifest.target["mcpu"]
    assert manifest.tvm_version == tvm.__version__
    assert manifest.bounds == {"batch": MAX_BATCH, "seq_len": 512}
    assert manifest.model_config["hidden_size"] == 384 and manifest.normalize_embeddings
    for name in (LIBRARY_FILE, PARAMS_FILE, "tokenizer.json"):
        assert manifest.files[name] == sha256_file(minilm_artifact / name)
    assert not list(minilm_artifact.parent.glob(".*")), "staging directories were left behind"


def test_second_compile_reuses_the_cached_artifact(minilm_artifact: Path, cache_dir: Path) -> None:
    before = (minilm_artifact / LIBRARY_FILE).stat().st_mtime_ns
    messages: list[str] = []
    again = compile_artifact(CompileRequest(model="default", max_batch=MAX_BATCH), cache_dir, progress=messages.append)
    assert again == minilm_artifact
    assert any("up to date" in m for m in messages)
    assert (minilm_artifact / LIBRARY_FILE).stat().st_mtime_ns == before


def test_a_cache_hit_marks_the_entry_used(minilm_artifact: Path, cache_dir: Path) -> None:
    """``dietserve cache --prune`` keeps the most recently used entries: a hit counts as a use."""
    os.utime(minilm_artifact, (1_000_000, 1_000_000))
    compile_artifact(CompileRequest(model="default", max_batch=MAX_BATCH), cache_dir)
    assert abs(minilm_artifact.stat().st_mtime - time.time()) < 600


@pytest.fixture
def artifact_copy(minilm_artifact: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "artifact"
    shutil.copytree(minilm_artifact, copy)
    return copy


def _edit_manifest(directory: Path, **changes) -> None:
    raw = json.loads((directory / MANIFEST_FILE).read_text())
    raw.update(changes)
    (directory / MANIFEST_FILE).write_text(json.dumps(raw))


def test_damaged_file_is_named(artifact_copy: Path) -> None:
    with open(artifact_copy / PARAMS_FILE, "r+b") as stream:
        stream.seek(1000)
        stream.write(b"\x00\x01\x02\x03")
    with pytest.raises(ArtifactError, match=f"{PARAMS_FILE} does not match its manifest"):
        load_artifact(artifact_copy)


def test_missing_file_is_named(artifact_copy: Path) -> None:
    (artifact_copy / LIBRARY_FILE).unlink()
    with pytest.raises(ArtifactError, match=f"{LIBRARY_FILE} is missing"):
        load_artifact(artifact_copy)


def test_cpu_lacking_required_features_is_refused(artifact_copy: Path) -> None:
    _edit_manifest(artifact_copy, required_cpu_flags=["avx2", "imaginary_isa_flag"])
    with pytest.raises(ArtifactError, match="this CPU lacks imaginary_isa_flag"):
        load_artifact(artifact_copy)


def test_other_tvm_version_is_refused(artifact_copy: Path) -> None:
    _edit_manifest(artifact_copy, tvm_version="0.1.0")
    with pytest.raises(ArtifactError, match="built with TVM 0.1.0"):
        load_artifact(artifact_copy)


def test_not_an_artifact_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load_artifact(tmp_path)


def test_artifact_loads_in_a_fresh_process_on_the_runtime_library_without_torch(minilm_artifact: Path) -> None:
    texts = ["dynamic shapes", "static shapes are easy"]
    # ``python -m dietserve embed ...``, then what it left in sys.modules and which TVM library
    # it loaded (on stderr)
    command = ("import runpy, sys\n"
               "try:\n    runpy.run_module('dietserve', run_name='__main__', alter_sys=True)\n"
               "except SystemExit:\n    pass\n"
               "import tvm\n"
               "print(sorted(m for m in sys.modules if sys.modules[m] is not None), file=sys.stderr)\n"
               "print(tvm.base._RUNTIME_ONLY, file=sys.stderr)")
    completed = subprocess.run(
        [sys.executable, "-c", command, "embed", "--artifact", str(minilm_artifact), "--json", *texts],
        capture_output=True, text=True, timeout=300, check=True,
    )
    theirs = np.array(json.loads(completed.stdout)["embeddings"])
    ours = Embedder(Engine(load_artifact(minilm_artifact))).embed(texts)
    np.testing.assert_allclose(theirs, ours, atol=1e-6)
    # torch is installed here (the references need it), and tvm_ffi imports it where it is
    # (``dietserve/host/startup.py``): a command never does.
    *_, modules, runtime_only = completed.stderr.strip().splitlines()
    assert runtime_only == "True"  # an artifact to run, nothing to compile
    loaded = ast.literal_eval(modules)
    assert "tvm" in loaded and "tvm_ffi" in loaded
    assert not [name for name in loaded if name.split(".")[0] == "torch"]


def test_the_target_command_names_what_a_compile_here_targets(minilm_artifact: Path) -> None:
    """What ``serve`` asks of ``python -m dietserve target`` to choose its host's version store and
    versions (it has TVM's runtime alone): the target the compile here wrote in the manifest."""
    done = subprocess.run([sys.executable, "-m", "dietserve", "target"], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout) == Manifest.read(minilm_artifact).target
    cores = subprocess.run([sys.executable, "-m", "dietserve", "target", "--num-cores", "3", "--mcpu", "x86-64"],
                           capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(cores.stdout) == {"kind": "llvm", "mcpu": "x86-64", "num-cores": "3"}


def test_a_load_leaves_the_weights_resident_once(minilm_artifact: Path) -> None:
    """What the load frees (the stored weights, read from the file and copied onto huge pages)
    goes back to the system: it left 83 MiB resident beside MiniLM's 86 MiB of weights."""
    measured = resident_growth_of_load(minilm_artifact)
    assert measured["grown"] < 1.2 * measured["weights"], measured  # (it was 2x)


def test_cli_prints_a_similarity_matrix(minilm_artifact: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "dietserve", "embed", "--artifact", str(minilm_artifact), "--similarity",
         "A man is eating food.", "A man is eating bread.", "The sky is blue."],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line.split()[-3:] for line in completed.stdout.strip().splitlines()]
    matrix = np.array(rows, dtype=float)
    np.testing.assert_allclose(np.diag(matrix), 1.0, atol=1e-3)
    assert matrix[0, 1] > matrix[0, 2]


def test_cli_reports_a_bad_model_folder(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "dietserve", "compile", "--model", str(tmp_path / "nope"), "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 2
    assert "does not exist" in completed.stderr


def test_more_threads_than_the_artifact_was_compiled_for_are_warned_of(minilm_artifact: Path, caplog) -> None:
    """Its dense kernels share their tasks among the target's num-cores workers: threads beyond
    that idle there, and the engine says so, naming the flag that fixes it."""
    loaded = load_artifact(minilm_artifact)
    cores = int(loaded.manifest.target["num-cores"])
    try:
        with caplog.at_level("WARNING", logger="dietserve.runtime.engine"):
            Engine(loaded, threads=cores)
            assert not caplog.records
            Engine(loaded, threads=cores + 2)
        (record,) = caplog.records
        assert f"compiled for {cores} cores" in record.getMessage()
        assert f"--num-cores {cores + 2}" in record.getMessage()
    finally:
        Engine(loaded)  # (the thread pool back to every CPU, for the tests after this one)
