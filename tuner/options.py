"""What a tune is asked for (``TuneOptions``) and what it returns (``TuneResult``): the tuning
loop's (``tune.py``) inputs and output, read by the command line and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

from dietserve.kernels.plan import KernelPlan

from .weight_stream import DramRates

DEFAULT_APPLY = "dietserve.kernels.apply:apply_kernel"


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 256  # micro-kernel measurements (each builds one candidate)
    time_budget_s: float | None = None
    candidates_per_round: int = 8
    shapes_per_round: int = 2
    max_variants: int = 4
    max_intervals: int = 8  # leaves of the decision tree (each is a scheduled copy in the code)
    loop_partition: bool = False
    # "module:function" applying a kernel (a custom schedule), called as ``apply_kernel`` is:
    # (func, kernel, target: tvm Target, loop_partition)
    apply: str = DEFAULT_APPLY
    seed: int = 0
    # The machine's DRAM read rates: plans then rank dense kernels as served, their weight from
    # DRAM (``weight_stream.served_estimates``); None: as timed, the weight in cache.
    dram: DramRates | None = None
    # Before the final plan, each shape's finalists timed again side by side (``race.py``): on a
    # shared host the search's single timings rank near-equal kernels by when each was timed.
    race: bool = True
    # CPU candidates timed beside a reference kernel of their shape and kept on its scale
    # (``reference_scale.py``): the host's speed moves within minutes, the ratio of two kernels
    # timed together far less.
    reference_timing: bool = True

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
