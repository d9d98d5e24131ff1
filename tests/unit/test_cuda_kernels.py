"""The load-time CUDA hook returns the prebuilt fatbin only for the source it was built from."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import tvm_ffi

from dietserve.runtime.cuda_kernels import CALLBACK, install_prebuilt_kernels


def test_hook_serves_the_fatbin_for_the_matching_source(tmp_path: Path) -> None:
    source = 'extern "C" __global__ void k() {}'
    fatbin = tmp_path / "kernels.fatbin"
    fatbin.write_bytes(b"\x50\xed\x55\xba payload")
    install_prebuilt_kernels(fatbin, hashlib.sha256(source.encode()).hexdigest())
    hook = tvm_ffi.get_global_func(CALLBACK)
    assert bytes(hook(source)) == fatbin.read_bytes()
    with pytest.raises(Exception, match="has no prebuilt fatbin"):
        hook(source + "// changed")
