"""Tuning task descriptions: what the model compiler hands the tuner, as a file.

One JSON file lists the model's dynamic matmul-like operators, one entry per distinct workload
(shared by every layer that calls it):

    format, version   "dietserve.tuning-tasks", 1
    model             display name and config digest of the model the operators come from
    target            the TVM target as a dict (kind, mcpu | arch, num-cores)
    tasks             [{workload, operator, calls, func (TVM JSON of the PrimFunc),
                        vary: {var, values}, fixed: {var: value}, weights: [one per value],
                        softmax: whether the model softmaxes the result's rows right after it
                        (CPU: served as one kernel, so tuned as one; absent = false)}]
    attention         a packed model's attention kernels, or absent: {heads, head_dim, max_len,
                      weights: one per sequence length 1..max_len; empty = uniform,
                      kv_heads (absent: heads), kernels: [{calls, relative_bias, window,
                      causal}], each masking as served and the layers calling it (absent: one
                      plain kernel)}
    precision         the build's dense products, "fp32" or "bf16" (absent: fp32): the tuner
                      times the kernels of that arithmetic and writes plans for it

The tuner reads it, tunes, and answers with one kernel plan per task (``kernel_plan.py``) and an
attention plan for the attention task (``attention_plan.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...host.atomic_io import write_text_atomic
from .kernel_plan import PRECISIONS

TASKS_FORMAT = "dietserve.tuning-tasks"
TASKS_VERSION = 1


class TuningError(RuntimeError):
    """The tuner could not run or failed."""


class TaskFileError(ValueError):
    """A task description file is malformed."""


@dataclass(frozen=True)
class TaskDescription:
    workload: str  # matching.workload_key of the PrimFunc
    operator: str  # the PrimFunc's name in the model
    calls: int  # call sites in the model (layers)
    func: str  # tvm.ir.save_json of the PrimFunc
    vary: dict  # {"var": "seq_len", "values": [1, ..., 512]}
    fixed: dict = field(default_factory=dict)  # e.g. {"batch": 1}
    weights: list = field(default_factory=list)  # one per value of vary; empty = uniform
    softmax: bool = False  # served fused with a softmax over the result's last axis (attention's scores)

    def __post_init__(self) -> None:
        values = self.vary.get("values") if isinstance(self.vary, dict) else None
        if not isinstance(self.vary, dict) or not isinstance(self.vary.get("var"), str) or not values:
            raise TaskFileError(f"task {self.operator}: vary must be {{var, values}}, got {self.vary!r}")
        if any(type(v) is not int or v < 1 for v in values):
            raise TaskFileError(f"task {self.operator}: values of {self.vary['var']} must be positive integers")
        if self.weights and (len(self.weights) != len(values) or min(self.weights) < 0 or sum(self.weights) <= 0):
            raise TaskFileError(f"task {self.operator}: weights must be non-negative, one per value, not all zero")
        if type(self.softmax) is not bool:
            raise TaskFileError(f"task {self.operator}: softmax must be true or false, got {self.softmax!r}")


@dataclass(frozen=True)
class AttentionKernel:
    """One of a model's attention kernels as it is served (``varlen_attention``'s masking) and
    how many layers call it: the tiles are timed on what each layer runs."""

    calls: int
    relative_bias: bool = False  # a bias by distance on the scores (MPNet's; a window or a causal mask)
    window: int | None = None  # key tiles farther than this from every query of a tile are skipped
    causal: bool = False  # key tiles after a query tile's last query are skipped

    def __post_init__(self) -> None:
        if type(self.calls) is not int or self.calls < 1:
            raise TaskFileError(f"attention kernel: calls must be a positive integer, got {self.calls!r}")
        if type(self.relative_bias) is not bool or type(self.causal) is not bool:
            raise TaskFileError("attention kernel: relative_bias and causal must be true or false")
        if self.window is not None and (type(self.window) is not int or self.window < 0):
            raise TaskFileError(f"attention kernel: window must be a non-negative integer, got {self.window!r}")
        if (self.window is not None or self.causal) and not self.relative_bias:
            raise TaskFileError("attention kernel: a window or a causal mask is the bias's: it needs relative_bias")

    def masking(self) -> dict:
        """``varlen_attention``'s arguments for this kernel."""
        return {"relative_bias": self.relative_bias, "window": self.window, "causal": self.causal}


@dataclass(frozen=True)
class AttentionTask:
    """A packed model's attention kernels: heads, the longest sequence, how often each length
    1..max_len is seen (empty: every length alike), the key and value heads and each kernel."""

    heads: int
    head_dim: int
    max_len: int
    weights: list = field(default_factory=list)
    kv_heads: int | None = None  # None: one per query head
    kernels: tuple[AttentionKernel, ...] = ()  # empty: one plain kernel in every layer

    def __post_init__(self) -> None:
        if any(type(v) is not int or v < 1 for v in (self.heads, self.head_dim, self.max_len)):
            raise TaskFileError(f"attention task: heads, head_dim and max_len must be positive integers, got "
                                f"{self.heads!r}, {self.head_dim!r}, {self.max_len!r}")
        if self.weights and (len(self.weights) != self.max_len or min(self.weights) < 0 or sum(self.weights) <= 0):
            raise TaskFileError("attention task: weights must be non-negative, one per length 1..max_len, not all zero")
        if self.kv_heads is not None and (type(self.kv_heads) is not int or self.kv_heads < 1
                                          or self.heads % self.kv_heads):
            raise TaskFileError(f"attention task: kv_heads must divide the {self.heads} heads, got {self.kv_heads!r}")
        try:
            kernels = tuple(k if isinstance(k, AttentionKernel) else AttentionKernel(**k) for k in self.kernels)
        except TypeError as err:
            raise TaskFileError(f"attention task: a kernel is malformed: {err}") from None
        object.__setattr__(self, "kernels", kernels or (AttentionKernel(calls=1),))


@dataclass(frozen=True)
class TaskFile:
    model: dict
    target: dict
    tasks: list  # of TaskDescription
    attention: AttentionTask | None = None
    format: str = TASKS_FORMAT
    version: int = TASKS_VERSION
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise TaskFileError(f"task file precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")

    def to_json(self) -> str:
        raw = asdict(self)
        return json.dumps(raw, indent=1, sort_keys=True)

    def write(self, path: Path) -> Path:
        write_text_atomic(path, self.to_json())
        return Path(path)

    @classmethod
    def read(cls, path: Path) -> TaskFile:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise TaskFileError(f"cannot read task file {path}: {err}") from err
        if not isinstance(raw, dict) or raw.get("format") != TASKS_FORMAT:
            raise TaskFileError(f"{path} is not a tuning task file (format {TASKS_FORMAT!r})")
        if raw.get("version") != TASKS_VERSION:
            raise TaskFileError(f"{path} has version {raw.get('version')}; this reads version {TASKS_VERSION}")
        try:
            tasks = [TaskDescription(**task) for task in raw["tasks"]]
            attention = AttentionTask(**raw["attention"]) if raw.get("attention") is not None else None
            return cls(raw["model"], raw["target"], tasks, attention, precision=raw.get("precision", "fp32"))
        except (KeyError, TypeError) as err:
            raise TaskFileError(f"{path} is incomplete: {err}") from err
