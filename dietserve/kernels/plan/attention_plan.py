"""The attention plan: what tuning chose for a packed model's attention kernel (one per model
shape of heads), and the one module that reads, writes and checks it.

A plan file (JSON, ``varlen_attention[H=<heads>,d=<head_dim>].attention.json`` beside the kernel
plans):

    format, version   "dietserve.attention-plan", 1
    heads, head_dim   the model's attention heads
    target            {"kind", "mcpu", "num-cores"} as in a kernel plan
    tvm_version       the TVM the tiles were built and timed with
    tiles             name -> register tile (``cpu_varlen/tile.py`` fields)
    tree              decision tree over ``length``, each sequence's own (``decision_tree.py``)
    lengths           per timed length: its weight, the tile chosen, and every tile's seconds
                      per sequence there
    provenance        tuner version, tuning seconds, where the weights came from
    precision         "fp32", or "bf16": the tiles timed with bf16 products (absent: fp32)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..cpu_varlen.tile import LENGTH_VAR, VarlenTile
from .decision_tree import TreeError, check_tree, leaves
from .kernel_plan import PlanError, PlanFile, check_tuned_for

ATTENTION_FORMAT = "dietserve.attention-plan"
ATTENTION_VERSION = 1
ATTENTION_SUFFIX = ".attention.json"


def attention_workload(heads: int, head_dim: int) -> str:
    return f"varlen_attention[H={heads},d={head_dim}]"


@dataclass(frozen=True)
class AttentionPlan(PlanFile):
    FORMAT = ATTENTION_FORMAT
    KIND = "an attention plan"

    heads: int
    head_dim: int
    target: dict
    tvm_version: str
    tiles: dict  # name -> VarlenTile fields
    tree: dict
    lengths: list = field(default_factory=list)
    provenance: dict = field(default_factory=dict)
    format: str = ATTENTION_FORMAT
    version: int = ATTENTION_VERSION
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.format != ATTENTION_FORMAT:
            raise PlanError(f"not an attention plan (format {self.format!r}, expected {ATTENTION_FORMAT!r})")
        self._check_precision_field()
        if self.version != ATTENTION_VERSION:
            raise PlanError(f"attention plan version {self.version}; this dietserve reads version {ATTENTION_VERSION}")
        if any(type(v) is not int or v < 1 for v in (self.heads, self.head_dim)):
            raise PlanError(f"attention plan: heads and head_dim must be positive integers, got "
                            f"{self.heads!r}, {self.head_dim!r}")
        if not isinstance(self.tiles, dict) or not self.tiles:
            raise PlanError(f"attention plan of {self.workload} lists no tiles")
        for name, raw in self.tiles.items():
            try:
                VarlenTile(**raw)
            except (TypeError, ValueError) as err:
                raise PlanError(f"attention plan of {self.workload}: tile {name!r} is not a register tile: {err}") \
                    from err
        try:
            check_tree(self.tree, self.tiles, [LENGTH_VAR])
        except TreeError as err:
            raise PlanError(f"attention plan of {self.workload}: {err}") from err
        branches = [self.tree]
        while branches:
            node = branches.pop()
            if "variant" not in node:
                if node["var"] != LENGTH_VAR:
                    raise PlanError(f"attention plan of {self.workload}: its tree branches on {node['var']!r}, "
                                    f"not {LENGTH_VAR!r}")
                branches += [node["then"], node["else"]]
        unused = set(self.tiles) - set(leaves(self.tree))
        if unused:
            raise PlanError(f"attention plan of {self.workload}: tiles {sorted(unused)} are reached by no leaf")
        if not isinstance(self.target, dict) or "kind" not in self.target:
            raise PlanError(f"attention plan of {self.workload}: target {self.target!r} names no kind")

    @property
    def workload(self) -> str:
        return attention_workload(self.heads, self.head_dim)

    def varlen_tiles(self) -> dict[str, VarlenTile]:
        return {name: VarlenTile(**raw) for name, raw in self.tiles.items()}

    def check_target(self, target: Mapping, tvm_version: str) -> None:
        check_tuned_for(f"attention plan {self.workload}", self.target, self.tvm_version, target, tvm_version)


def attention_plan_path(directory: Path, heads: int, head_dim: int) -> Path:
    return Path(directory) / f"{attention_workload(heads, head_dim)}{ATTENTION_SUFFIX}"


def is_attention_plan(path: Path) -> bool:
    return Path(path).name.endswith(ATTENTION_SUFFIX)


def read_attention_plans(paths: Iterable[Path]) -> list[AttentionPlan]:
    """Attention plans among plan files and directories (every ``*.attention.json`` inside); one
    per workload."""
    plans: dict[str, tuple[AttentionPlan, Path]] = {}
    for path in map(Path, paths):
        if path.is_dir():
            files = sorted(path.glob(f"*{ATTENTION_SUFFIX}"))
        else:
            files = [path] if is_attention_plan(path) else []
        for file in files:
            plan = AttentionPlan.read(file)
            if plan.workload in plans:
                raise PlanError(f"two attention plans for {plan.workload}: {plans[plan.workload][1]} and {file}")
            plans[plan.workload] = (plan, file)
    return [plan for plan, _ in plans.values()]
