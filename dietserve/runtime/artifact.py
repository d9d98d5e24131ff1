"""Load a compiled artifact after checking it fits this machine and is intact."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from safetensors.numpy import load_file
from tvm.runtime.vm import VirtualMachine

from ..host.cpu import AMX_FLAGS, cpu_flags, missing_cpu_flags, refused_tile_state
from .cuda_kernels import FATBIN_FILE, install_prebuilt_kernels
from .huge_pages import on_huge_pages
from .manifest import LIBRARY_FILE, PARAMS_FILE, ArtifactError, Manifest, sha256_file
from .memory import release_freed_heap


@dataclass
class LoadedArtifact:
    directory: Path
    manifest: Manifest
    device: tvm.runtime.Device
    vm: VirtualMachine
    params: list  # tvm tensors on ``device``, in ``forward``'s argument order (packed if it packs)


def verify_files(directory: Path, manifest: Manifest) -> None:
    for name, expected in manifest.files.items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"artifact {directory} is incomplete: {name} is missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ArtifactError(
                f"artifact file {path} does not match its manifest (sha256 {actual[:16]}..., "
                f"expected {expected[:16]}...): the artifact is damaged or was modified; recompile it"
            )


def choose_device(manifest: Manifest) -> tvm.runtime.Device:
    """The device the artifact was built for, after checking this machine has it."""
    kind = manifest.target.get("kind")
    if kind == "llvm":
        missing = missing_cpu_flags(manifest.required_cpu_flags, cpu_flags())
        if missing:
            raise ArtifactError(
                f"artifact was compiled for CPU {manifest.target.get('mcpu')!r}; this CPU lacks "
                f"{', '.join(missing)}. Recompile on this machine (or name an older --mcpu)."
            )
        if manifest.precision == "bf16" and AMX_FLAGS <= set(manifest.required_cpu_flags):
            # Its kernels may run on AMX tiles, which Linux lends a process only on request: a
            # refusal (a sandbox that blocks arch_prctl) would end the process at the first call.
            refused = refused_tile_state()
            if refused is not None:
                raise ArtifactError(
                    f"artifact's bf16 kernels may use AMX tiles, and this process may not (Linux refused "
                    f"arch_prctl(ARCH_REQ_XCOMP_PERM): {refused}). Recompile with an --mcpu without AMX "
                    f"(e.g. icelake-server), or allow that system call.")
        return tvm.cpu(0)
    if kind == "cuda":
        device = tvm.cuda(0)
        if not device.exist:
            raise ArtifactError("artifact was compiled for CUDA but this machine has no CUDA GPU")
        built_for = (manifest.cuda_arch or "").removeprefix("sm_")
        have = str(device.compute_version).replace(".", "")
        if built_for != have:
            raise ArtifactError(
                f"artifact was compiled for sm_{built_for}; this GPU is sm_{have}. Recompile with --arch sm_{have}."
            )
        return device
    raise ArtifactError(f"artifact target kind {kind!r} is not supported")


def load_artifact(directory: Path, verify_hashes: bool = True, huge_pages: bool = True) -> LoadedArtifact:
    """The artifact in ``directory``, ready to run; ``huge_pages``: a CPU artifact's weights
    copied onto transparent huge pages (``huge_pages.py``), else left where TVM allocated them."""
    directory = Path(directory)
    manifest = Manifest.read(directory)
    if manifest.tvm_version != str(tvm.__version__):
        raise ArtifactError(
            f"artifact was built with TVM {manifest.tvm_version}; this runtime is TVM {tvm.__version__}"
        )
    if verify_hashes:
        verify_files(directory, manifest)
    device = choose_device(manifest)
    if manifest.cuda_source_sha256 is not None:
        install_prebuilt_kernels(directory / FATBIN_FILE, manifest.cuda_source_sha256)
    library = tvm.runtime.load_module(str(directory / LIBRARY_FILE))
    vm = VirtualMachine(library, device)
    stored = load_file(str(directory / PARAMS_FILE))
    params = []
    for name, shape in manifest.parameters:
        tensor = stored.get(name)
        if tensor is None or list(tensor.shape) != list(shape):
            raise ArtifactError(f"{PARAMS_FILE} in {directory} lacks {name} with shape {shape}")
        params.append(tvm.runtime.tensor(np.ascontiguousarray(tensor), device))
    del stored  # (copied: not held through the packing and the copy below)
    if manifest.transform_params is not None:
        # Pack the weights the kernels read in panels, once; the stored layout is then dropped.
        # On a VM of its own that allocates without a pool: the serving VM's pooled allocator
        # keeps every buffer freed for reuse by one of the same size, so the packed weights'
        # first buffers, freed once copied onto huge pages below (or when a hot swap drops
        # this version), would stay resident for good: bert-base's server held 415 MiB of them.
        packer = VirtualMachine(library, device, memory_cfg="naive")
        params = list(packer[manifest.transform_params](params))  # takes the parameters as one tuple
        del packer
    if huge_pages and manifest.target.get("kind") == "llvm":
        params = on_huge_pages(params)  # each request streams them all: see huge_pages.py
    release_freed_heap()  # the stored layout's buffers, freed above
    return LoadedArtifact(directory, manifest, device, vm, params)
