"""The one stand-in runner of the tuner's tests: a synthetic machine whose latencies come from a
formula, no build, no worker. What it tests is the search's bookkeeping; the real measurements
are ``test_tuner_measure.py``'s."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from dietserve.kernels.plan.microkernel import MicroKernel
from tuner.measure.job import MeasureJob, MeasureResult, RunnerFeatures

Latency = Callable[[MicroKernel | None, Mapping[str, int]], float]


class FakeRunner:
    """Times each job's kernel (None: the default rule's) at ``latency(kernel, shape)``;
    keeps every job it ran (``jobs``) and was asked to build ahead (``prepared``)."""

    def __init__(self, latency: Latency, features: RunnerFeatures | None = None) -> None:
        self.latency = latency
        self.features = features or RunnerFeatures()
        self.jobs: list[MeasureJob] = []
        self.prepared: list[MeasureJob] = []

    def describe(self) -> str:
        return "synthetic"

    def run(self, job: MeasureJob) -> MeasureResult:
        self.jobs.append(job)
        return MeasureResult(latencies=tuple(self.latency(self.kernel(job), shape) for shape in job.shapes),
                             build_seconds=0.0)

    def prepare(self, jobs: Sequence[MeasureJob]) -> None:
        self.prepared.extend(jobs)

    @staticmethod
    def kernel(job: MeasureJob) -> MicroKernel | None:
        return None if job.kernel is None else MicroKernel.from_json(job.kernel)

    def kernels(self) -> list[MicroKernel | None]:
        """The kernels of the jobs run, in order."""
        return [self.kernel(job) for job in self.jobs]
