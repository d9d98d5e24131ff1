"""Compilation targets: the host CPU (features detected or named) and CUDA GPUs by architecture."""

from __future__ import annotations

import os
from dataclasses import dataclass

import tvm
from tvm.target import Target

from ..host.cpu import host_cpu


class TargetError(ValueError):
    """A target name, CPU or GPU architecture that we cannot compile for."""


@dataclass(frozen=True)
class TargetSpec:
    """What to compile for, as a user names it: ``llvm`` (host) or ``cuda``."""

    kind: str = "llvm"
    mcpu: str | None = None  # llvm: None detects the host CPU
    num_cores: int | None = None  # llvm: None uses the host's core count
    arch: str = "sm_90"  # cuda

    def __post_init__(self) -> None:
        if self.kind not in ("llvm", "cuda"):
            raise TargetError(f"target {self.kind!r} is not supported; use 'llvm' or 'cuda'")
        if self.kind == "cuda" and not (self.arch.startswith("sm_") and self.arch[3:].isdigit()):
            raise TargetError(f"CUDA architecture {self.arch!r} must look like sm_90")


def build_target(spec: TargetSpec) -> Target:
    """The TVM target for a spec; CPU features default to the machine compiling.

    A CUDA artifact's host code is only VM glue, so it targets generic x86-64 by default and
    loads on any GPU server, whatever CPU built it.
    """
    default_cpu = host_cpu() if spec.kind == "llvm" else "x86-64"
    host = {"kind": "llvm", "mcpu": spec.mcpu or default_cpu, "num-cores": spec.num_cores or os.cpu_count() or 1}
    if spec.kind == "llvm":
        from tvm.target.codegen import llvm_is_valid_cpu

        if not llvm_is_valid_cpu(host["mcpu"], "x86_64-linux-gnu"):
            raise TargetError(f"LLVM does not know the CPU {host['mcpu']!r}")
        return Target(host)
    return Target({"kind": "cuda", "arch": spec.arch}, host=host)


def target_description(target: Target) -> dict:
    """A JSON-able record of the target for manifests and cache keys."""
    kept = ("kind", "mcpu", "arch", "num-cores")
    description = {key: str(value) for key, value in target.export().items() if key in kept}
    if target.host is not None and target.kind.name != "llvm":
        description["host"] = target_description(target.host)
    return description


def tvm_version() -> str:
    return str(tvm.__version__)
