"""CUDA artifacts build on a machine without a GPU: dlight schedules, nvcc fatbin, manifest."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.compile.target import TargetSpec
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.cuda_kernels import FATBIN_FILE
from dietserve.runtime.manifest import ArtifactError, Manifest, sha256_file

from ..conftest import cuda_gpu_available

FATBIN_MAGIC = bytes.fromhex("50ed55ba")

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@pytest.fixture(scope="module")
def cuda_artifact(cache_dir: Path) -> Path:
    request = CompileRequest(model="default", target=TargetSpec(kind="cuda", arch="sm_90"), max_batch=8)
    return compile_artifact(request, cache_dir)


def test_cuda_artifact_carries_a_fatbin_for_its_architecture(cuda_artifact: Path) -> None:
    manifest = Manifest.read(cuda_artifact)
    assert manifest.target["kind"] == "cuda" and manifest.cuda_arch == "sm_90"
    assert manifest.target["host"]["mcpu"] == "x86-64"
    fatbin = (cuda_artifact / FATBIN_FILE).read_bytes()
    assert fatbin[:4] == FATBIN_MAGIC
    assert b"sm_90" in fatbin or len(fatbin) > 10_000
    assert manifest.files[FATBIN_FILE] == sha256_file(cuda_artifact / FATBIN_FILE)
    assert manifest.cuda_source_sha256 and len(manifest.cuda_source_sha256) == 64


def test_sm75_builds_too(cache_dir: Path) -> None:
    request = CompileRequest(model="default", target=TargetSpec(kind="cuda", arch="sm_75"), max_batch=2)
    artifact = compile_artifact(request, cache_dir)
    assert (artifact / FATBIN_FILE).read_bytes()[:4] == FATBIN_MAGIC


@pytest.mark.skipif(cuda_gpu_available(), reason="checks the message given on a machine without a GPU")
def test_loading_without_a_gpu_says_so(cuda_artifact: Path) -> None:
    with pytest.raises(ArtifactError, match="no CUDA GPU"):
        load_artifact(cuda_artifact)
