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


def test_cuda_artifact_with_split_plans_builds(cache_dir: Path, tmp_path: Path) -> None:
    """Micro-kernels that stage operands in shared memory behind the decision tree's branches:
    TVM's ThreadSync refused them ("Cannot insert syncs inside condition") until the tree's
    conditions were marked thread-invariant (found on an H100)."""
    import tvm

    from dietserve.compile.tuning import tuning_tasks
    from dietserve.kernels.plan.decision_tree import interval_tree
    from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan, plan_path
    from dietserve.kernels.plan.microkernel import MicroKernel
    from dietserve.kernels.tir.matching import matmul_axes

    def cuda(tm, ty, tn, tx, bk):
        return MicroKernel(tile=(("i", (tm, ty)), ("j", (tn, tx)), ("k", (bk,))), unroll=64, vector=4,
                           cache_scopes=("shared", "local")).to_dict()

    variants = {"narrow": cuda(4, 2, 2, 16, 32), "typical": cuda(4, 8, 4, 16, 16), DEFAULT_VARIANT: None}
    splits = [(8, "narrow"), (16, DEFAULT_VARIANT), (128, "narrow"), (4096, "typical")]
    request = CompileRequest(model="default", target=TargetSpec(kind="cuda", arch="sm_90"), max_batch=8)
    tasks = tuning_tasks(request, cache_dir)
    assert not any(task.softmax for task in tasks.tasks)  # the softmax is fused on CPU only
    for task in tasks.tasks:
        if task.vary["var"] != "seq_len":  # the pooling sum: no [i,k]x[k,j] product to tile
            continue
        axes = matmul_axes(tvm.ir.load_json(task.func))
        KernelPlan(workload=task.workload, operator=task.operator, shape_vars=["batch", "seq_len"], axes=axes,
                   target=tasks.target, tvm_version=str(tvm.__version__), variants=variants,
                   tree=interval_tree(axes["i"], [v for v, _ in splits], [n for _, n in splits]),
                   tuned_range={"var": axes["i"], "min": 1, "max": 4096},
                   provenance={"model": {"name": "test"}}).write(plan_path(tmp_path / "plans", task.workload))
    import dataclasses

    artifact = compile_artifact(dataclasses.replace(request, plans=(tmp_path / "plans",)), cache_dir,
                                tmp_path / "artifact")
    manifest = Manifest.read(artifact)
    assert (artifact / FATBIN_FILE).read_bytes()[:4] == FATBIN_MAGIC
    assert any(len(entry["variants"]) == 3 for entry in manifest.dispatch.values())


@pytest.mark.skipif(cuda_gpu_available(), reason="checks the message given on a machine without a GPU")
def test_loading_without_a_gpu_says_so(cuda_artifact: Path) -> None:
    with pytest.raises(ArtifactError, match="no CUDA GPU"):
        load_artifact(cuda_artifact)
