"""Shared test configuration: GPU tests skip cleanly on machines without an NVIDIA GPU."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def cuda_gpu_available() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - any failure to probe means no usable GPU
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none found by tvm.cuda(0).exist)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
