"""Serve an artifact's prebuilt CUDA fatbin to TVM's load-time CUDA compile hook.

The exported library carries its kernels as CUDA source, and TVM asks the global function
``tvm_callback_cuda_compile`` to turn that source into device code when the library loads.
We answer with the fatbin nvcc built at compile time, after checking that the source is the
one it was built from, so no compiler is needed on the GPU host.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import tvm_ffi

from .manifest import ArtifactError

CALLBACK = "tvm_callback_cuda_compile"
FATBIN_FILE = "kernels.fatbin"


def install_prebuilt_kernels(fatbin_path: Path, source_sha256: str) -> None:
    fatbin = Path(fatbin_path).read_bytes()

    def prebuilt(code: str, *_unused: object) -> bytes:
        digest = hashlib.sha256(code.encode()).hexdigest()
        if digest != source_sha256:
            raise ArtifactError(
                f"CUDA source {digest[:16]}... has no prebuilt fatbin (artifact holds {source_sha256[:16]}...)"
            )
        return fatbin

    tvm_ffi.register_global_func(CALLBACK, prebuilt, override=True)
