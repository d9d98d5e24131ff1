"""Compiled CUDA artifacts carried to a GPU host without their weights (a call carries 64 MiB at
most): here each is copied without ``params.safetensors`` and with a map of where each parameter
comes from in the checkpoint; there the parameters are assembled again from the checkpoint's
tensors and checked against the manifest's sha256. Also the hand-made split plans that stand in
for tuned ones until a tune has measured on a GPU. Numpy only at import: the GPU host imports it
with TVM's runtime alone."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

ARCH = "sm_90"
MAX_BATCH = 8
PARAMS_FILE = "params.safetensors"
PARAM_MAP_FILE = "param_map.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def assemble(tensors: dict, keys: list[str], transposed: bool) -> np.ndarray:
    from dietserve.model.side_by_side import side_by_side  # (numpy only: the GPU host imports it too)

    return side_by_side([tensors[key] for key in keys], transposed)


def param_map(artifact: Path, checkpoint: Path) -> list[list]:
    """[artifact param name, [checkpoint tensor names], transposed] for every artifact parameter:
    the tensors, each transposed if so, side by side along the last axis make the parameter (the
    fused QKV layer stacks the query, key and value projections). Built from the model's own
    source map and checked against the artifact's parameters, bit for bit."""
    from safetensors.numpy import load_file

    from dietserve.model.bert import BertModel, checkpoint_parts, transposed_weight_names
    from dietserve.model.checkpoint import Checkpoint
    from dietserve.model.family_tensors import canonical_name
    from dietserve.runtime.manifest import Manifest

    ours = load_file(str(artifact / PARAMS_FILE))
    theirs = load_file(str(checkpoint / "model.safetensors"))
    opened = Checkpoint.open(checkpoint)
    model = BertModel(opened.config, opened.pooling)
    sources, transposed = checkpoint_parts(model), transposed_weight_names(model)
    raw_key = {canonical_name(key): key for key in theirs}
    mapping = []
    for name, _shape in Manifest.read(artifact).parameters:
        keys = [raw_key[part] for part in sources[name]]
        if not np.array_equal(assemble(theirs, keys, name in transposed), ours[name]):
            raise ValueError(f"artifact parameter {name} is not {keys} side by side")
        mapping.append([name, keys, name in transposed])
    return mapping


def carry_artifact(artifact: Path, checkpoint: Path, destination: Path) -> None:
    """``artifact`` copied to ``destination`` without its parameters, with their map."""
    mapping = param_map(artifact, checkpoint)
    shutil.copytree(artifact, destination, ignore=shutil.ignore_patterns(PARAMS_FILE))
    (destination / PARAM_MAP_FILE).write_text(json.dumps(mapping))


def restore_params(carried: Path, destination: Path, tensors: dict) -> bool:
    """A carried artifact copied to ``destination`` with its parameters assembled from the
    checkpoint ``tensors``; whether they hash as the manifest says (else: not the same weights)."""
    from safetensors.numpy import save_file

    from dietserve.runtime.manifest import Manifest

    if not (destination / PARAMS_FILE).exists():
        shutil.rmtree(destination, ignore_errors=True)
        shutil.copytree(carried, destination)
        mapping = json.loads((carried / PARAM_MAP_FILE).read_text())
        params = {name: assemble(tensors, keys, transposed) for name, keys, transposed in mapping}
        save_file(params, str(destination / PARAMS_FILE))
    return sha256_file(destination / PARAMS_FILE) == Manifest.read(destination).files[PARAMS_FILE]


def cuda_core_kernel(tm: int, ty: int, tn: int, tx: int, bk: int, vector: int = 4, unroll: int = 64) -> dict:
    from dietserve.kernels.plan.microkernel import MicroKernel

    return MicroKernel(tile=(("i", (tm, ty)), ("j", (tn, tx)), ("k", (bk,))), unroll=unroll, vector=vector,
                       cache_scopes=("shared", "local")).to_dict()


def cuda_core_split() -> tuple[dict, list]:
    """The fastest of the bundle's kernels for MiniLM's 384->1536 dense on an H100 (first run,
    2026-11): "narrow" up to 128 rows, "typical" above. Plus the default rule for 9..16 rows, so
    that one operator mixes dlight's kernel and micro-kernels. (variants, [(up to rows, name)])."""
    from dietserve.kernels.plan.kernel_plan import DEFAULT_VARIANT

    variants = {"narrow": cuda_core_kernel(4, 2, 2, 16, 32, vector=4, unroll=0),
                "typical": cuda_core_kernel(4, 8, 4, 16, 16), DEFAULT_VARIANT: None}
    return variants, [(8, "narrow"), (16, DEFAULT_VARIANT), (128, "narrow"), (4096, "typical")]


def tensor_core_split() -> tuple[dict, list]:
    """Products of 17 rows and more on tensor cores (fp16 operands, fp32 sums), the narrowest on
    CUDA cores, where a 16-row tensor-core tile would be mostly padding."""
    from dietserve.kernels.space.gpu_tensor_core import tensor_core_kernel

    variants = {"narrow": cuda_core_split()[0]["narrow"], "tc": tensor_core_kernel(2, 2, 2, 2, 2).to_dict()}
    return variants, [(16, "narrow"), (4096, "tc")]


def hand_plans(folder: Path, checkpoint: Path, cache: Path, split: tuple[dict, list]) -> Path:
    """Hand-made CUDA plans for every dense and attention product of the model: ``split``'s
    micro-kernels by row count (as tests/integration/test_tuned_model.py does on CPU)."""
    import tvm

    from dietserve.compile.artifact import CompileRequest
    from dietserve.compile.target import TargetSpec
    from dietserve.compile.tuning import tuning_tasks
    from dietserve.kernels.plan.decision_tree import interval_tree
    from dietserve.kernels.plan.kernel_plan import KernelPlan, plan_path
    from dietserve.kernels.tir.matching import matmul_axes

    variants, splits = split
    request = CompileRequest(model=str(checkpoint), target=TargetSpec(kind="cuda", arch=ARCH), max_batch=MAX_BATCH)
    tasks = tuning_tasks(request, cache)
    shutil.rmtree(folder, ignore_errors=True)
    for task in tasks.tasks:
        if task.vary["var"] != "seq_len":
            # The pooling sum (rows = batch, reduced over seq_len) is no [i,k]x[k,j] product: its
            # staged operand tile spans i, k and j, and these tiles overflow 48 KiB of shared
            # memory there (ptxas refuses). The tuner would drop such candidates; we leave it out.
            continue
        axes = matmul_axes(tvm.ir.load_json(task.func))
        plan = KernelPlan(workload=task.workload, operator=task.operator, shape_vars=["batch", "seq_len"], axes=axes,
                          target=tasks.target, tvm_version=str(tvm.__version__), variants=variants,
                          tree=interval_tree(axes["i"], [v for v, _ in splits], [n for _, n in splits]),
                          tuned_range={"var": axes["i"], "min": 1, "max": 4096},
                          provenance={"model": {"name": "hand-made CUDA plan (tests/gpu/carried_artifacts.py)"}})
        plan.write(plan_path(folder, task.workload))
    return folder
