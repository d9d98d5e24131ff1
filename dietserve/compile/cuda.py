"""Compile generated CUDA to a fatbin with nvcc while building, so that the exported library
carries device code and a GPU host needs no compiler (TVM otherwise embeds source or needs
NVRTC from cuda-bindings at build time)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import tvm_ffi

_CALLBACK = "tvm_callback_cuda_compile"


class CudaToolchainError(RuntimeError):
    """nvcc is needed to build CUDA artifacts and was not found."""


@contextlib.contextmanager
def nvcc_fatbin(arch: str) -> Iterator[None]:
    """Route TVM's CUDA compile callback to nvcc producing a fatbin for ``arch`` (sm_XX)."""
    from tvm.support import nvcc

    if shutil.which("nvcc") is None:
        raise CudaToolchainError("nvcc is not on PATH; it is needed to compile CUDA artifacts")
    previous = tvm_ffi.get_global_func(_CALLBACK, allow_missing=True)
    suffix = arch.removeprefix("sm_")

    def compile_to_fatbin(code: str, *_target: object) -> bytearray:
        gencode = ["-gencode", f"arch=compute_{suffix},code=sm_{suffix}"]
        return nvcc.compile_cuda(code, target_format="fatbin", arch=gencode, compiler="nvcc")

    tvm_ffi.register_global_func(_CALLBACK, compile_to_fatbin, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(_CALLBACK, previous, override=True)
