"""What each executed batch adds to the metrics, the traffic record and the measured swap gain."""

from __future__ import annotations

from prometheus_client import Counter

from ..runtime.batcher import BatchRun
from .metrics import ModelMetrics
from .swap import MeasuredGain
from .traffic_log import TrafficLog


class BatchRecorder:
    """The batcher's ``on_batch`` callback."""

    def __init__(self, metrics: ModelMetrics, traffic: TrafficLog, gain: MeasuredGain):
        self.metrics, self.traffic, self.gain = metrics, traffic, gain
        # labels() is a lookup under a lock; a model has dozens of dynamic operators per batch.
        self._dispatch_counters: dict[tuple[str, str], Counter] = {}

    def __call__(self, run: BatchRun) -> None:
        metrics = self.metrics
        self.traffic.record(run)
        self.gain.record(run.rows, run.seq_len, run.compute_seconds)
        computed = run.rows * run.seq_len
        metrics.compute_duration.observe(run.compute_seconds)
        metrics.batch_size.observe(run.rows)
        metrics.computed_tokens.inc(computed)
        metrics.padding_tokens.inc(computed - run.real_tokens)
        metrics.padding_ratio.observe((computed - run.real_tokens) / computed)
        for length in run.row_lengths:
            metrics.sequence_length.observe(length)
        for operator, variant, executions in run.variants:
            self._dispatch_counter(operator, variant).inc(executions)

    def _dispatch_counter(self, operator: str, variant: str) -> Counter:
        counter = self._dispatch_counters.get((operator, variant))
        if counter is None:
            counter = self._dispatch_counters[(operator, variant)] = self.metrics.kernel_dispatch.labels(
                operator, variant)
        return counter
