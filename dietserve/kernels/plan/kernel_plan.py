"""The kernel plan: what tuning produced for one dynamic operator, and the one module that
reads, writes and checks it (the tuner writes plans; the link pass and the server read them).

A plan file (JSON, one per tuned workload):

    format, version      "dietserve.kernel-plan", 1
    workload             structural key of the operator's PrimFunc (matching.workload_key)
    operator             its name in the model it was tuned from (for people, never matched)
    shape_vars           the PrimFunc's symbolic vars, e.g. ["batch", "seq_len"]
    axes                 the matmul's axes as shape text, e.g. {"b": "1", "i": "batch * seq_len", ...}
    target               {"kind", "mcpu" | "arch", "num-cores"} as in the artifact manifest
    tvm_version          the TVM the kernels were built and measured with
    variants             name -> micro-kernel (MicroKernel fields) or null for the default rule;
                         packed-weight kernels (``pack`` > 0) all share one panel width, and
                         then the plan has no default variant (it reads the unpacked weight)
    tree                 decision tree over shape text (dietserve.kernels.plan.decision_tree)
    tuned_range          {"var": text, "min": int, "max": int}: shapes above max take the tree's
                         last interval, a variant that is correct for every shape
    shapes               per tuned shape: value, chosen variant, latency, measured or predicted,
                         and the default rule's latency there
    provenance           records file and digest, trials, tuning seconds, shape weights, model
    precision            "fp32", or "bf16": its packed kernels multiply bf16 (absent: fp32)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...host.atomic_io import write_text_atomic
from .decision_tree import TreeError, check_tree, leaves
from .microkernel import MicroKernel

PLAN_FORMAT = "dietserve.kernel-plan"
PLAN_VERSION = 1
DEFAULT_VARIANT = "default"  # the default schedule rule's own kernel (what an untuned build runs)
PLAN_SUFFIX = ".plan.json"
MATCHED_TARGET_KEYS = ("kind", "mcpu", "arch")  # what decides the ISA; num-cores may differ
PRECISIONS = ("fp32", "bf16")  # of the dense layers' products (``kernels/cpu_packed/bf16.py``)


class PlanError(ValueError):
    """A plan file is malformed, stale (other TVM or target) or foreign (not this model's)."""


class PlanFile:
    """What every plan file does alike (a frozen dataclass with a ``format`` field, and
    ``FORMAT`` and ``KIND`` on the class): JSON out, digest, atomic write, and read back with its
    format, fields and own checks verified."""

    FORMAT: str
    KIND: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def write(self, path: Path) -> Path:
        write_text_atomic(path, self.to_json())
        return Path(path)

    @classmethod
    def from_dict(cls, raw: object, source: str = "plan"):
        if not isinstance(raw, dict):
            raise PlanError(f"{source} is not a JSON object")
        if raw.get("format") != cls.FORMAT:
            raise PlanError(f"{source} is not {cls.KIND} (format {raw.get('format')!r}, expected {cls.FORMAT!r})")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise PlanError(f"{source} has unknown fields {sorted(unknown)}")
        try:
            return cls(**raw)
        except TypeError as err:
            raise PlanError(f"{source} is incomplete: {err}") from err
        except PlanError as err:
            raise PlanError(f"{source}: {err}") from err

    @classmethod
    def read(cls, path: Path):
        return cls.from_dict(read_json(path), str(path))

    def check_precision(self, precision: str) -> None:
        """Refuse a plan timed at another precision (stale: its kernels were chosen for other
        arithmetic)."""
        if self.precision != precision:
            raise PlanError(f"{self.KIND} of {self.workload} was tuned for {self.precision} products, this build "
                            f"is {precision}: tune it again for {precision}")

    def _check_precision_field(self) -> None:
        if self.precision not in PRECISIONS:
            raise PlanError(f"{self.KIND} of {self.workload}: precision {self.precision!r} is not one of {PRECISIONS}")


@dataclass(frozen=True)
class KernelPlan(PlanFile):
    FORMAT = PLAN_FORMAT
    KIND = "a kernel plan"

    workload: str
    operator: str
    shape_vars: list
    axes: dict
    target: dict
    tvm_version: str
    variants: dict  # name -> MicroKernel fields, or None for DEFAULT_VARIANT
    tree: dict
    tuned_range: dict
    shapes: list = field(default_factory=list)
    provenance: dict = field(default_factory=dict)
    format: str = PLAN_FORMAT
    version: int = PLAN_VERSION
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.format != PLAN_FORMAT:
            raise PlanError(f"not a kernel plan (format {self.format!r}, expected {PLAN_FORMAT!r})")
        self._check_precision_field()
        if self.version != PLAN_VERSION:
            raise PlanError(f"kernel plan version {self.version}; this dietserve reads version {PLAN_VERSION}")
        if not isinstance(self.variants, dict) or not self.variants:
            raise PlanError(f"plan of {self.operator} lists no variants")
        for name, kernel in self.variants.items():
            if (kernel is None) != (name == DEFAULT_VARIANT):
                raise PlanError(f"plan of {self.operator}: only variant {DEFAULT_VARIANT!r} may be null (the "
                                f"default rule), {name!r} is {kernel!r}")
            if kernel is not None:
                try:
                    MicroKernel.from_dict(kernel)
                except (KeyError, TypeError, ValueError) as err:
                    raise PlanError(f"plan of {self.operator}: variant {name!r} is not a micro-kernel: {err}") from err
        packs = {0 if kernel is None else kernel.get("pack", 0) for kernel in self.variants.values()}
        if len(packs) > 1:
            raise PlanError(f"plan of {self.operator}: variants read the weight in different layouts (panel "
                            f"widths {sorted(packs)}; 0 = unpacked); one packing per operator")
        try:
            check_tree(self.tree, self.variants, self.shape_vars)
        except TreeError as err:
            raise PlanError(f"plan of {self.operator}: {err}") from err
        unused = set(self.variants) - set(leaves(self.tree))
        if unused:
            raise PlanError(f"plan of {self.operator}: variants {sorted(unused)} are reached by no leaf")
        if not {"kind"} <= set(self.target):
            raise PlanError(f"plan of {self.operator}: target {self.target!r} names no kind")

    def kernel(self, name: str) -> MicroKernel | None:
        """The variant's micro-kernel; None for the default rule's kernel."""
        raw = self.variants[name]
        return None if raw is None else MicroKernel.from_dict(raw)

    @property
    def pack(self) -> int:
        """Panel width every variant's packed weight has; 0 when the weight stays unpacked."""
        kernel = next(iter(self.variants.values()))
        return 0 if kernel is None else int(kernel.get("pack", 0))

    def check_target(self, target: Mapping, tvm_version: str) -> None:
        """Refuse a plan tuned with another TVM or for another target/ISA (stale)."""
        check_tuned_for(f"plan of {self.operator} ({self.workload})", self.target, self.tvm_version, target,
                        tvm_version)


def read_json(path: Path) -> object:
    """A plan file's JSON, or a ``PlanError`` naming the file."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise PlanError(f"cannot read plan {path}: {err}") from err
    except json.JSONDecodeError as err:
        raise PlanError(f"plan {path} is not valid JSON: {err}") from err


def check_tuned_for(what: str, tuned_target: Mapping, tuned_tvm: str, target: Mapping, tvm_version: str) -> None:
    """Refuse what was tuned with another TVM or for another target/ISA (stale)."""
    if tuned_tvm != tvm_version:
        raise PlanError(f"{what} was tuned with TVM {tuned_tvm}; this is TVM {tvm_version}: re-tune")
    for key in MATCHED_TARGET_KEYS:
        if tuned_target.get(key) != target.get(key):
            raise PlanError(f"{what} was tuned for {key}={tuned_target.get(key)!r}; compiling for "
                            f"{key}={target.get(key)!r}: re-tune")


def plan_path(directory: Path, workload: str) -> Path:
    return Path(directory) / f"{workload}{PLAN_SUFFIX}"


def read_plans(paths: Iterable[Path]) -> list[KernelPlan]:
    """Plans from files and directories (every ``*.plan.json`` inside); one per workload."""
    plans: dict[str, tuple[KernelPlan, Path]] = {}
    for path in paths:
        path = Path(path)
        if path.is_dir():
            files = sorted(path.glob(f"*{PLAN_SUFFIX}"))
        elif path.exists():
            files = [path]
        else:
            raise PlanError(f"plan path {path} does not exist")
        for file in files:
            plan = KernelPlan.read(file)
            if plan.workload in plans:
                raise PlanError(f"two plans for workload {plan.workload}: {plans[plan.workload][1]} and {file}")
            plans[plan.workload] = (plan, file)
    return [plan for plan, _ in sorted(plans.values(), key=lambda item: item[0].workload)]


def predicted_latency(plan: KernelPlan, shape: Mapping[str, int]) -> float | None:
    """Seconds the plan's kernel takes at ``shape``, from the tuned shape nearest along the tuned
    range's variable (measured where possible), scaled by the ratio of the values (rows), since a
    dense kernel's time grows with its rows. None if the plan records no latencies."""
    from .decision_tree import evaluate_text

    entries = [entry for entry in plan.shapes if entry.get("latency_s") and entry.get("value")]
    if not entries:
        return None
    value = int(evaluate_text(plan.tuned_range["var"], shape))
    nearest = min(entries, key=lambda e: (abs(e["value"] - value), not e.get("measured", False)))
    return nearest["latency_s"] * value / nearest["value"]

