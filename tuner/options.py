"""What a tune is asked for (``TuneOptions``) and what it returns (``TuneResult``)."""

from __future__ import annotations

from dataclasses import dataclass

from dietserve.kernels.plan.kernel_plan import KernelPlan

from .measure.job import DEFAULT_APPLY
from .planning.weight_stream import DramRates


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 256  # micro-kernel measurements (each builds one candidate)
    time_budget_s: float | None = None
    candidates_per_round: int = 8
    shapes_per_round: int = 2
    max_variants: int = 4
    max_intervals: int = 8  # leaves of the decision tree (each is a scheduled copy in the code)
    loop_partition: bool = False
    # "module:function" applying a kernel, called as ``apply_kernel`` is
    apply: str = DEFAULT_APPLY
    seed: int = 0
    # Given, plans rank dense kernels as served, their weight from DRAM; None: as timed, cached.
    dram: DramRates | None = None

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"trials must be at least 1, got {self.trials}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time budget must be positive, got {self.time_budget_s}")
        if self.max_variants < 1 or self.candidates_per_round < 1 or self.shapes_per_round < 1:
            raise ValueError("max_variants, candidates_per_round and shapes_per_round must be positive")


@dataclass
class TuneResult:
    plan: KernelPlan
    trials: int
    failures: int
    wall_s: float
