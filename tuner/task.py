"""A tuning task: one operator with symbolic dims, the shape instances it must serve and a
weight per instance (DietCode's ``ShapeVar`` and ``wkl_inst_weights``), for one target."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dietserve.kernels.tir.matching import evaluate, matmul_axes, matmul_extents

from .ops import OperatorSpec


@dataclass(frozen=True)
class ShapeVar:
    """A symbolic dimension and the values it takes, e.g. ``ShapeVar("T", range(1, 513))``."""

    name: str
    values: tuple[int, ...]

    def __init__(self, name: str, values) -> None:
        values = tuple(int(v) for v in values)
        if not values or min(values) < 1:
            raise ValueError(f"shape var {name!r} needs positive values, got {values[:5]}...")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "values", values)

    @classmethod
    def parse(cls, name: str, text: str) -> ShapeVar:
        """``"1:512"`` (inclusive range), ``"1:512:8"`` (with step) or ``"1,7,128"``."""
        try:
            if ":" in text:
                parts = [int(p) for p in text.split(":")]
                start, stop, step = (parts + [1])[:3] if len(parts) < 3 else parts
                return cls(name, range(start, stop + 1, step))
            return cls(name, [int(p) for p in text.split(",")])
        except ValueError as err:
            raise ValueError(f"cannot parse values of {name!r} from {text!r}: use 1:512, 1:512:8 or 1,7,128 "
                             f"({err})") from err


@dataclass(frozen=True, eq=False)  # identity hash: caches key on the task object
class TuningTask:
    spec: OperatorSpec
    target: dict  # a TVM target as a dict
    instances: tuple[tuple[tuple[str, int], ...], ...]  # each a sorted (var, value) tuple
    weights: tuple[float, ...]
    fixed: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, spec: OperatorSpec, target: dict, variable: ShapeVar,
               weights: Sequence[float] | None = None, fixed: Mapping[str, int] | None = None) -> TuningTask:
        """Instances vary ``variable``; other symbolic vars take ``fixed`` values."""
        fixed = dict(fixed or {})
        missing = set(spec.shape_vars) - {variable.name} - set(fixed)
        if variable.name not in spec.shape_vars:
            raise ValueError(f"{spec.name} has symbolic vars {spec.shape_vars}, not {variable.name!r}")
        if missing:
            raise ValueError(f"{spec.name}: give values for symbolic vars {sorted(missing)}")
        weights = tuple(float(w) for w in (weights if weights is not None else [1.0] * len(variable.values)))
        if len(weights) != len(variable.values) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError("weights must be non-negative, one per instance, not all zero")
        instances = tuple(tuple(sorted({**fixed, variable.name: value}.items())) for value in variable.values)
        return cls(spec, dict(target), instances, weights, fixed)

    @property
    def workload(self) -> str:
        return self.spec.name

    @property
    def target_key(self) -> str:
        return " ".join(f"{k}={v}" for k, v in sorted(self.target.items()) if k != "host")

    def shapes(self) -> list[dict[str, int]]:
        return [dict(instance) for instance in self.instances]

    def varying(self) -> str:
        """The one var the instances differ in (the dispatch key)."""
        for name in self.spec.shape_vars:
            if name not in self.fixed:
                return name
        raise AssertionError("a task varies one var")

    def check_shape(self) -> dict[str, int]:
        """A small instance whose var is prime (near 13), so no tile divides it: a kernel checked
        there exercises its padding paths."""
        var = self.varying()
        values = sorted({dict(instance)[var] for instance in self.instances})
        primes = [v for v in values if v > 2 and all(v % d for d in range(2, math.isqrt(v) + 1))]
        value = min(primes, key=lambda v: abs(v - 13)) if primes else values[len(values) // 2]
        return {**self.fixed, var: value}

    def flops(self, shape: Mapping[str, int]) -> int:
        return _flops_cached(self, tuple(sorted(shape.items())))

    @functools.cached_property
    def _extents(self):
        return matmul_extents(self.spec.func)

    @functools.cached_property
    def axes(self) -> dict[str, str]:
        """The matmul's axes as shape text (``b``, ``i``, ``j``, ``k``)."""
        return matmul_axes(self.spec.func)

    @property
    def dispatch_var(self) -> str:
        """What the dispatch tree branches on: the operator's row count as shape text (dense:
        ``batch * seq_len``; attention: ``seq_len``)."""
        return self.axes["i"]

    def dispatch_value(self, shape: Mapping[str, int]) -> int:
        return self.axis_extents(shape)["i"]

    def axis_extents(self, shape: Mapping[str, int]) -> dict[str, int]:
        """Concrete extents of the matmul's axes: ``b`` (all batch axes), ``i``, ``j``, ``k``."""
        return dict(_axis_extents_cached(self, tuple(sorted(shape.items()))))


@functools.lru_cache(maxsize=65536)
def _flops_cached(task: TuningTask, key: tuple) -> int:
    return task.spec.flops(dict(key))  # cached: a plan prices every candidate on every shape


@functools.lru_cache(maxsize=65536)
def _axis_extents_cached(task: TuningTask, key: tuple) -> tuple:
    *batch, i, j, k = [evaluate(extent, dict(key)) for extent in task._extents]
    return (("b", math.prod(batch)), ("i", i), ("j", j), ("k", k))
