"""The artifact manifest: what was compiled, for which machine, and the hashes of its files."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..host.atomic_io import write_text_atomic
from ..kernels.plan.kernel_plan import PRECISIONS

__all__ = ["ArtifactError", "Manifest", "sha256_file", "write_text_atomic"]

MANIFEST_FILE = "manifest.json"
LIBRARY_FILE = "model.so"
PARAMS_FILE = "params.safetensors"
PLANS_DIR = "plans"  # the kernel plans linked into a tuned artifact
PLANS_TUNED, PLANS_ANALYTIC, PLANS_NONE = "tuned", "analytic", "none"  # Manifest.kernel_plans
PLAN_MODES = (PLANS_ANALYTIC, PLANS_NONE)  # what --plans takes besides plan files
# Manifest.layout: the encoder on [batch, seq] rows, padding masked; or on the requests' tokens
# packed one sequence after another (model/bert.py forward_packed), no padded work.
LAYOUT_PADDED, LAYOUT_PACKED = "padded", "packed"
LAYOUTS = (LAYOUT_PADDED, LAYOUT_PACKED)
PACKED_INPUTS = ["input_ids", "token_type_ids", "position_ids", "starts", "unpack", "attention_mask",
                 "padded_positions"]
# 2: dispatch entries per matmul operator with workload, plan, calls; 3: packed weights;
# 4: the head (pooling recipe or classifier) and each output's shape
FORMAT_VERSION = 4
EMBEDDING_TASK, CLASSIFICATION_TASK = "embedding", "classification"


def default_layout(target_kind: str) -> str:
    """A build's layout where none is asked for: packed where its attention kernel exists (CPU
    targets), padded on CUDA, which has none yet. On a CPU the padded layout is kept as the CUDA
    graph's twin (docs/measurements/goals.md: packed against padded)."""
    return LAYOUT_PACKED if target_kind == "llvm" else LAYOUT_PADDED


class ArtifactError(RuntimeError):
    """An artifact directory is missing, damaged, or built for another machine or TVM."""


@dataclass(frozen=True)
class Manifest:
    model_name: str
    model_config: dict
    normalize_embeddings: bool
    target: dict
    tvm_version: str
    cache_key: str
    bounds: dict  # symbolic var -> inclusive upper bound, e.g. {"batch": 64, "seq_len": 512}
    parameters: list  # [[name, shape], ...] in the order the compiled function takes them
    files: dict  # file name -> sha256
    required_cpu_flags: list = field(default_factory=list)  # /proc/cpuinfo names, llvm only
    cuda_arch: str | None = None
    cuda_source_sha256: str | None = None  # the kernels' source, which kernels.fatbin was built from
    inputs: list = field(default_factory=lambda: ["input_ids", "attention_mask", "token_type_ids", "position_ids"])
    outputs: list = field(default_factory=lambda: ["last_hidden_state", "sentence_embedding"])
    # output name -> shape, -1 where it follows the request (batch, sequence length)
    output_shapes: dict = field(default_factory=dict)
    task: str = EMBEDDING_TASK  # or CLASSIFICATION_TASK: logits in place of sentence_embedding
    # EMBEDDING_TASK: {"modes": [...], "dense": [...], "normalize": bool}, or for a sparse encoder
    # {"splade": {...}} (model/heads.py PoolingOptions.to_dict)
    pooling: dict | None = None
    # CLASSIFICATION_TASK: {"num_labels": n, "id2label": {"0": name, ...}}
    classifier: dict | None = None
    # dynamic operator -> {"symbolic": [vars], "variants": [names], "tree": decision tree}; see
    # dietserve/runtime/variant_by_shape.py. Untuned artifacts have one variant per operator, "default".
    dispatch: dict = field(default_factory=dict)
    # The library function that lays the parameters out for ``forward`` (packed weights), run
    # once at load: forward(*inputs, *transform_params(parameters)). None: parameters as stored.
    transform_params: str | None = None
    # How it was built (compile/artifact.py CompileRequest.build_record): model, target, bounds.
    # A re-tuning job builds the served model from it. None: an artifact from before it was kept.
    build: dict | None = None
    # What chose its kernels: PLANS_TUNED (measured on a host), PLANS_ANALYTIC (the hardware
    # model, a cold start), PLANS_NONE (the default rule). None: from before it was kept.
    kernel_plans: str | None = None
    layout: str = LAYOUT_PADDED  # one of LAYOUTS; ``inputs`` are the compiled function's
    # The dense layers' products: "fp32", or "bf16" (bf16 inputs and weights, fp32 sums).
    precision: str = "fp32"
    format_version: int = FORMAT_VERSION
    created_by: str = "dietserve"

    @property
    def max_batch(self) -> int:
        return int(self.bounds["batch"])

    @property
    def max_seq_len(self) -> int:
        return int(self.bounds["seq_len"])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST_FILE
        if not path.is_file():
            raise ArtifactError(f"{directory} is not an artifact: {MANIFEST_FILE} is missing")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ArtifactError(f"{path} is not valid JSON: {err}") from err
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"{path} has format version {version}; this dietserve reads version {FORMAT_VERSION}. "
                "Recompile the artifact."
            )
        try:
            manifest = cls(**raw)
        except TypeError as err:
            raise ArtifactError(f"{path} does not describe an artifact: {err}") from err
        if manifest.layout not in LAYOUTS:
            raise ArtifactError(f"{path}: layout {manifest.layout!r} is not one of {', '.join(LAYOUTS)}")
        if manifest.precision not in PRECISIONS:
            raise ArtifactError(f"{path}: precision {manifest.precision!r} is not one of {', '.join(PRECISIONS)}")
        return manifest


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (a file: its own size); links not followed."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(chunk):
            digest.update(block)
    return digest.hexdigest()
