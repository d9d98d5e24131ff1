"""The settings every kernel family is built with, chosen once per target (``kernel_settings``)
and passed down from ``apply`` and ``decision_tree_func`` to the families that read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm.target import Target

from .cpu_clamped.settings import ClampedSettings
from .cpu_packed.settings import PackedSettings, packed_settings


@dataclass(frozen=True)
class KernelSettings:
    packed: PackedSettings = field(default_factory=PackedSettings)
    clamped: ClampedSettings = field(default_factory=ClampedSettings)


def kernel_settings(target: Target) -> KernelSettings:
    """The settings the model is built with for ``target``."""
    return KernelSettings(packed=packed_settings(target), clamped=ClampedSettings())


__all__ = ["KernelSettings", "kernel_settings"]
