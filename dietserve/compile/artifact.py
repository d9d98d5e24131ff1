"""Build a versioned artifact directory: exported library, converted weights, tokenizer files
and a manifest with content hashes. Written to a temporary directory and renamed into place,
and reused when its cache key (everything that determines the build) is unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.numpy import save_file

from ..host.cpu import target_cpu_flags
from ..host.hardware import CpuHardware
from ..kernels.cpu_packed.bf16 import check_bf16_target
from ..kernels.cpu_varlen.splade_pool import splade_pool
from ..kernels.plan.attention_plan import AttentionPlan, attention_plan_path, is_attention_plan, read_attention_plans
from ..kernels.plan.kernel_plan import DEFAULT_VARIANT, KernelPlan, PlanError, plan_path, read_plans
from ..kernels.space.analytic import ANALYTIC_SOURCE
from ..model.bert import PACKED_VARS, SHAPE_VARS, export_relax
from ..model.checkpoint import Checkpoint, load_parameters
from ..model.presets import display_name
from ..model.tokenizer import PAIR_TEMPLATE_FILE, TOKENIZER_FILES
from ..runtime.cuda_kernels import FATBIN_FILE
from ..runtime.manifest import (
    LAYOUT_PACKED,
    LAYOUT_PADDED,
    LIBRARY_FILE,
    MANIFEST_FILE,
    PACKED_INPUTS,
    PARAMS_FILE,
    PLANS_ANALYTIC,
    PLANS_DIR,
    PLANS_NONE,
    PLANS_TUNED,
    ArtifactError,
    Manifest,
    sha256_file,
    write_text_atomic,
)
from .cache import ARTIFACTS_DIR, mark_used
from .passes.link_kernels import target_fields as link_target_fields
from .passes.pack_weights import TRANSFORM_PARAMS_SUFFIX
from .request import CompileRequest, Progress, open_checkpoint
from .target import build_target, target_description, tvm_version

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


def compiler_source_hash() -> str:
    """Hash of the code that determines what a build produces (model, compile, kernels)."""
    digest = hashlib.sha256()
    folders = [_SOURCE_ROOT / "model", _SOURCE_ROOT / "compile", _SOURCE_ROOT / "kernels"]
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            digest.update(path.relative_to(_SOURCE_ROOT.parent).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def required_cpu_flags(target) -> list[str]:
    return sorted(target_cpu_flags(target)) if target.kind.name == "llvm" else []


def cache_key(checkpoint: Checkpoint, weights_sha: list[str], target, max_batch: int,
              plans: list[KernelPlan] = (), analytic_for: CpuHardware | None = None,
              layout: str = LAYOUT_PADDED, attention: AttentionPlan | None = None, precision: str = "fp32") -> str:
    """``weights_sha``: the digests of ``checkpoint.weight_files``, in order; ``analytic_for``: the
    hardware model a build without plans plans its operators for (the plans follow from it, the
    model and the compiler's code, so a cached build is found without planning again)."""
    inputs = {
        "plans": sorted(plan.digest() for plan in plans),
        "analytic_for": dataclasses.asdict(analytic_for) if analytic_for is not None else None,
        "config": checkpoint.config.to_dict(),
        "head": checkpoint.head_description(),
        "weights": weights_sha,
        "text_files": {name: sha256_file(checkpoint.folder / name) for name in TOKENIZER_FILES
                       if (checkpoint.folder / name).is_file()},
        "target": target_description(target),
        "tvm": tvm_version(),
        "compiler": compiler_source_hash(),
        "max_batch": max_batch,
        "layout": layout,
        **({"attention": attention.digest()} if attention is not None else {}),
        **({"precision": precision} if precision != "fp32" else {}),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def default_artifact_dir(cache_dir: Path, name: str, kind: str, key: str) -> Path:
    return cache_dir / ARTIFACTS_DIR / f"{name}-{kind}-{key[:16]}"


def _is_current(directory: Path, key: str) -> bool:
    try:
        return Manifest.read(directory).cache_key == key
    except ArtifactError:
        return False


def compile_artifact(
    request: CompileRequest,
    cache_dir: Path,
    out_dir: Path | None = None,
    progress: Progress = lambda _message: None,
) -> Path:
    """Compile ``request`` into ``out_dir`` (default: a content-addressed cache entry)."""
    # (checked here, not in the request: a request without plans is also what a re-tuning job
    # builds its tasks from, and links its tuned plans into)
    if request.precision != "fp32" and not (request.plans or request.analytic):
        raise ValueError(f"{request.precision} products are built by planned kernels (--plans analytic or tuned "
                         f"plans); without plans every operator runs the default rule, in fp32")
    checkpoint = open_checkpoint(request, cache_dir, progress)
    folder = checkpoint.folder
    target = build_target(request.target)
    if request.precision == "bf16":
        check_bf16_target(target)
    progress(f"hashing weights in {checkpoint.folder}")
    weights_sha = [sha256_file(path) for path in checkpoint.weight_files]
    plans = read_plans(path for path in request.plans if not is_attention_plan(path))
    attention = _attention_plan(request, checkpoint.config)
    for plan in [*plans, *([attention] if attention else [])]:  # stale plans are refused before any work
        plan.check_target(link_target_fields(target), tvm_version())
    for plan in plans:
        plan.check_precision(request.precision)
    hardware = None
    if not plans and request.analytic:
        from .cold_start import target_hardware

        hardware = target_hardware(target)
        if hardware is None:
            progress(f"no analytic plans for a {target.kind.name} target: its operators keep the default rule")
    key = cache_key(checkpoint, weights_sha, target, request.max_batch, plans, hardware, request.layout, attention,
                    request.precision)
    name = display_name(request.model, folder)
    out_dir = Path(out_dir) if out_dir else default_artifact_dir(cache_dir, name, request.target.kind, key)
    if _is_current(out_dir, key):
        mark_used(out_dir)
        progress(f"artifact {out_dir} is up to date (cache key {key[:16]})")
        return out_dir

    if hardware is not None:
        from .cold_start import analytic_plans

        plans = analytic_plans(request, cache_dir, target, hardware, progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        _build_into(staging, checkpoint, target, request, name, key, plans, progress, attention)
        _replace_dir(staging, out_dir)
        mark_used(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress(f"wrote {out_dir}")
    return out_dir


def _attention_plan(request: CompileRequest, config) -> AttentionPlan | None:
    """The attention plan among the request's plans, for a packed build; None: the hardware's tile."""
    found = read_attention_plans(request.plans)
    if not found or request.layout != LAYOUT_PACKED:
        return None
    (plan, *others) = found
    if others or (plan.heads, plan.head_dim) != (config.num_attention_heads, config.head_dim):
        raise PlanError(f"attention plans {[p.workload for p in found]} are not for this model's "
                        f"{config.num_attention_heads} heads of {config.head_dim}")
    plan.check_precision(request.precision)
    return plan


def _build_into(staging, checkpoint, target, request, name, key, plans, progress,
                attention: AttentionPlan | None = None) -> None:
    from .passes import foreign_plans, link_tuned_kernels, linked_operators
    from .pipeline import compile_module

    model = checkpoint.model()
    mod, parameters = export_model(model, request, target, attention)
    params = load_parameters(checkpoint, model, parameters)
    started = time.perf_counter()
    tuned = f" with {len(plans)} {plan_source(plans)} kernel plan(s)" if plans else ""
    progress(f"compiling {name} for {json.dumps(target_description(target))}{tuned} (this takes a minute)")
    operators: dict[str, dict] = {}
    functions: set[str] = set()

    def inspect(scheduled) -> None:
        operators.update(linked_operators(scheduled))
        functions.update(gvar.name_hint for gvar in scheduled.get_global_vars())

    link = link_tuned_kernels(plans, target, tvm_version(), request.precision)
    executable = compile_module(mod, target, link_passes=[link],
                                inspect_scheduled=inspect)
    transform_params = f"forward{TRANSFORM_PARAMS_SUFFIX}"
    foreign_plans(plans, operators)
    executable.export_library(str(staging / LIBRARY_FILE))
    cuda_source_sha256 = None
    if request.target.kind == "cuda":
        from ..kernels.cuda.source import find_cuda_source
        from .cuda import CudaToolchainError, compile_fatbin, source_digest

        source = find_cuda_source(executable.mod)
        if source is None:
            raise CudaToolchainError("the CUDA build produced no CUDA module")
        progress(f"compiling CUDA kernels with nvcc for {request.target.arch}")
        (staging / FATBIN_FILE).write_bytes(compile_fatbin(source, target))
        cuda_source_sha256 = source_digest(source)
    progress(f"compiled in {time.perf_counter() - started:.1f} s; saving weights")
    save_file(params, str(staging / PARAMS_FILE))
    for file_name in TOKENIZER_FILES:
        source = checkpoint.folder / file_name
        if source.is_file():
            shutil.copy(source, staging / file_name)
    template = checkpoint.classifier.pair_template if checkpoint.classifier is not None else None
    if template is not None:
        write_text_atomic(staging / PAIR_TEMPLATE_FILE, json.dumps(template.to_dict(), indent=1))
    for plan in plans:  # what was linked in, for `explain` and for re-linking
        plan.write(plan_path(staging / PLANS_DIR, plan.workload))
    if attention is not None:
        attention.write(attention_plan_path(staging / PLANS_DIR, attention.heads, attention.head_dim))
    files = {path.relative_to(staging).as_posix(): sha256_file(path)
             for path in sorted(staging.rglob("*")) if path.is_file()}
    manifest = Manifest(
        model_name=name,
        model_config=checkpoint.config.to_dict(),
        normalize_embeddings=checkpoint.classifier is None and checkpoint.pooling.normalize,
        **checkpoint.head_description(),
        outputs=list(model.output_names),
        output_shapes=model.output_shapes(),
        target=target_description(target),
        tvm_version=tvm_version(),
        cache_key=key,
        bounds={"batch": request.max_batch, "seq_len": checkpoint.config.max_length},
        parameters=[[n, list(shape)] for n, shape in parameters],
        files=files,
        required_cpu_flags=required_cpu_flags(target.host if request.target.kind == "cuda" else target),
        cuda_arch=request.target.arch if request.target.kind == "cuda" else None,
        cuda_source_sha256=cuda_source_sha256,
        dispatch=dispatch_table(operators, plans),
        transform_params=transform_params if transform_params in functions else None,
        build=request.build_record(),
        kernel_plans=plan_source(plans),
        layout=request.layout,
        precision=request.precision,
        **({"inputs": PACKED_INPUTS} if request.layout == LAYOUT_PACKED else {}),
    )
    write_text_atomic(staging / MANIFEST_FILE, manifest.to_json())


def export_model(model, request: CompileRequest, target, attention: AttentionPlan | None = None) -> tuple:
    """``export_relax`` of the request's layout: the packed one with its attention kernels built
    from ``attention``'s tiles and tree, else the target's registers and vectors' tile (and a
    sparse encoder's pooling kernel)."""
    if request.layout != LAYOUT_PACKED:
        return export_relax(model, request.max_batch)
    from .cold_start import target_hardware
    from .packed_attention import attention_functions

    full, windowed = attention_functions(model.config, request.precision, target_hardware(target), attention)
    splade = model.pooling.splade
    pool = None if splade is None else splade_pool(splade.vocab_size, splade.strategy, splade.activation,
                                                   splade.decoder_columns)
    return export_relax(model, request.max_batch, full, windowed, pool)


def plan_source(plans: list[KernelPlan]) -> str:
    """What the artifact's kernels were chosen by (``Manifest.kernel_plans``): ``tuned`` where
    any plan came from measurements, ``analytic`` where all came from the hardware model,
    ``none`` without plans (the default rule everywhere)."""
    if not plans:
        return PLANS_NONE
    return PLANS_ANALYTIC if all(plan.provenance.get("source") == ANALYTIC_SOURCE for plan in plans) else PLANS_TUNED


def dispatch_table(operators: dict[str, dict], plans: list[KernelPlan]) -> dict:
    """Per dynamic matmul-like operator: its workload, call sites, variants and the decision tree
    compiled into it (one ``default`` variant where no plan was linked)."""
    by_digest = {plan.digest(): plan for plan in plans}
    table = {}
    for name, linked in operators.items():
        plan = by_digest.get(linked["plan"]) if linked["plan"] else None
        entry = {**linked, "shape_vars": list(SHAPE_VARS + PACKED_VARS)}
        if plan is None:
            entry.update(variants=[DEFAULT_VARIANT], tree={"variant": DEFAULT_VARIANT})
        else:
            entry.update(variants=sorted(plan.variants), tree=plan.tree, operator=plan.operator)
        table[name] = entry
    return table


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Swap ``staging`` into ``out_dir``; an old artifact there is removed only afterwards."""
    if out_dir.exists():
        retired = out_dir.with_name(f".{out_dir.name}-old-{os.getpid()}")
        os.replace(out_dir, retired)
        os.replace(staging, out_dir)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, out_dir)
