"""Compile an executable's generated CUDA source to a fatbin with nvcc at build time.

TVM 0.27 keeps CUDA kernels as source inside the exported library and compiles them when the
library is loaded, through the ``tvm_callback_cuda_compile`` hook (nvcc or NVRTC on the GPU
host). We compile here instead, on the build machine, and ship the fatbin in the artifact;
the runtime answers that hook with it (``runtime/cuda_kernels.py``), so a GPU host needs no
compiler and loads exactly the code that was built and hashed.
"""

from __future__ import annotations

import hashlib
import shutil

from tvm.target import Target


class CudaToolchainError(RuntimeError):
    """nvcc is needed to build CUDA artifacts and was not found or failed."""


def source_digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def compile_fatbin(source: str, target: Target) -> bytes:
    """nvcc -> fatbin holding SASS for the target's architecture (e.g. sm_90)."""
    from tvm.support import nvcc

    if shutil.which("nvcc") is None:
        raise CudaToolchainError("nvcc is not on PATH; it is needed to compile CUDA artifacts")
    arch = str(target.attrs["arch"]).removeprefix("sm_")
    gencode = ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    try:
        with target:
            return bytes(nvcc.compile_cuda(source, target_format="fatbin", arch=gencode, compiler="nvcc"))
    except RuntimeError as err:
        raise CudaToolchainError(f"nvcc failed to compile the generated CUDA kernels: {err}") from err
