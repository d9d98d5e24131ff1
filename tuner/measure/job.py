"""What crosses between the tuner and a runner: a ``MeasureJob`` in, a ``MeasureResult`` out, and
the ``Runner`` protocol that carries them. Both are frozen values, pickled across the worker's pipe;
the runner adds how to time and where as a ``WorkerJob``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_APPLY = "dietserve.kernels.apply:apply_kernel"


@dataclass(frozen=True)
class MeasureJob:
    """Build ``kernel`` (JSON; None: the default rule's) for the operator ``recipe``, check it on
    ``check_shape`` against numpy, then time it on each of ``shapes``. A candidate whose first warm
    call takes over ``abandon_above_s`` is timed once: it cannot win."""

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
    pending: bool = False  # sent to be measured elsewhere (``bundle.py``): no result yet

    @property
    def ok(self) -> bool:
        return self.error is None and not self.pending

    @property
    def latency(self) -> float:
        """The first shape's seconds per call (the tuner's jobs time one shape)."""
        if self.error is not None:
            raise ValueError(f"a failed measurement has no latency: {self.error}")
        return self.latencies[0]

    @classmethod
    def failed(cls, error: str, traceback: str | None = None) -> MeasureResult:
        return cls(error=error[:2000], traceback=traceback)


@dataclass(frozen=True)
class RunnerFeatures:
    """Whether ``prepare`` builds ahead in parallel, and whether the runner is on this machine."""

    builds_ahead: bool = False
    local: bool = False


class Runner(Protocol):
    """Carries jobs to a device: ``run`` builds, checks and times one, never raising for a bad
    candidate; ``prepare`` builds candidates ahead where it can (a no-op otherwise); ``describe``
    says where and how it measures, for records and logs."""

    features: RunnerFeatures

    def describe(self) -> str: ...
    def run(self, job: MeasureJob) -> MeasureResult: ...
    def prepare(self, jobs: Sequence[MeasureJob]) -> None: ...


@dataclass(frozen=True)
class WorkerJob:
    """A ``MeasureJob`` as a worker runs it: on ``device``, timed by ``timing`` (a
    ``timing.TimingPolicy``, typed loosely to keep timing code out of this module), keeping
    ``builds_kept`` builds; ``build_only`` stops after the check, ``compile_to`` after compiling
    to that path, and ``library`` is such a compiled candidate to load."""

    job: MeasureJob
    device: Mapping[str, object] = field(default_factory=lambda: {"kind": "local"})
    timing: object = None
    builds_kept: int = 64
    build_only: bool = False
    compile_to: str | None = None
    library: str | None = None


def build_key(work: WorkerJob) -> str:
    """What decides the compiled module and its check: everything but the shapes timed and how."""
    job = work.job
    return repr([job.recipe, sorted(job.target.items()), job.kernel, job.apply, job.loop_partition,
                 sorted(work.device.items()), sorted(job.check_shape.items())])
