"""What crosses between the tuner and a runner: a ``MeasureJob`` in, a ``MeasureResult`` out, and
the ``Runner`` protocol that carries them (a worker process on this machine, or an RPC device).

Both are frozen values (they are pickled across the worker's pipe); the runner adds how to time
(``timing.TimingPolicy``) and where (its device) as a ``WorkerJob``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_APPLY = "dietserve.kernels.apply:apply_kernel"


@dataclass(frozen=True)
class MeasureJob:
    """Build ``kernel`` (JSON; None: the default rule's own kernel) for the operator ``recipe``,
    check it on ``check_shape`` against numpy, then time it on each of ``shapes``.

    ``abandon_above_s``: a candidate whose first warm call takes longer is timed once, not
    repeated (it cannot win; the bar is a multiple of the best known on its shape)."""

    recipe: tuple
    target: Mapping[str, object]
    shapes: tuple[Mapping[str, int], ...]
    check_shape: Mapping[str, int]
    kernel: str | None
    apply: str = DEFAULT_APPLY
    loop_partition: bool = False
    abandon_above_s: float | None = None

    @property
    def shape(self) -> Mapping[str, int]:
        """The one shape of a single-shape job (the tuner's)."""
        (shape,) = self.shapes
        return shape


@dataclass(frozen=True)
class MeasureResult:
    """Seconds per call on each shape of the job (in its order), or the error that stopped it."""

    latencies: tuple[float, ...] = ()
    error: str | None = None
    traceback: str | None = None
    build_seconds: float | None = None
    build_reused: bool = False
    built_ahead: bool = False  # built by ``Runner.prepare`` before this job timed it
    seconds: float = 0.0
    library: str | None = None  # a builder worker's output (``WorkerJob.compile_to``)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        """The first shape's seconds per call (the tuner's jobs time one shape)."""
        if self.error is not None:
            raise ValueError(f"a failed measurement has no latency: {self.error}")
        return self.latencies[0]

    @classmethod
    def failed(cls, error: str, seconds: float = 0.0, traceback: str | None = None) -> MeasureResult:
        return cls(error=error[:2000], seconds=seconds, traceback=traceback)


@dataclass(frozen=True)
class RunnerFeatures:
    """What a runner can do beyond ``run``: build candidates ahead in parallel (``prepare`` does
    work), and whether it runs on this machine."""

    builds_ahead: bool = False
    local: bool = False


class Runner(Protocol):
    features: RunnerFeatures

    def describe(self) -> str:
        """Where and how it measures, for records and logs."""

    def run(self, job: MeasureJob) -> MeasureResult:
        """Build, check and time one job; never raises for a bad candidate."""

    def prepare(self, jobs: Sequence[MeasureJob]) -> None:
        """Build the candidates of ``jobs`` ahead where it can; a no-op otherwise."""


@dataclass(frozen=True)
class WorkerJob:
    """A ``MeasureJob`` as a worker process runs it: where (``device``), how it is timed, and
    what to do with the build (keep it, or only compile it into ``compile_to``)."""

    job: MeasureJob
    device: Mapping[str, object] = field(default_factory=lambda: {"kind": "local"})
    timing: object = None  # a ``timing.TimingPolicy`` (typed loosely: this module imports no timing code)
    builds_kept: int = 64
    build_only: bool = False
    compile_to: str | None = None
    library: str | None = None  # a library a builder worker compiled this candidate into

    def with_(self, **changes) -> WorkerJob:
        return dataclasses.replace(self, **changes)


def build_key(work: WorkerJob) -> str:
    """What decides the compiled module and its check: everything but the shapes timed and how."""
    job = work.job
    return repr([job.recipe, sorted(job.target.items()), job.kernel, job.apply, job.loop_partition,
                 sorted(work.device.items()), sorted(job.check_shape.items())])


def shape_text(shape: Mapping[str, int]) -> str:
    return ",".join(f"{name}={value}" for name, value in sorted(shape.items()))
