"""The server's record of its traffic (``runtime/traffic.py``): one entry per model execution,
written to the traffic file off the event loop every few seconds and at exit, and published as
a metric. A traffic file that cannot be read is reported, kept aside for inspection and replaced
by an empty record: losing the history must not stop a server from starting."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from ..host.atomic_io import write_text_atomic
from ..runtime.batcher import BatchRun
from ..runtime.traffic import Traffic, TrafficError
from .metrics import LENGTH_BUCKETS, ModelMetrics

log = logging.getLogger("dietserve.server")


class TrafficLog:
    def __init__(self, path: Path | None, half_life_seconds: float, metrics: ModelMetrics):
        self.path = path
        self.metrics = metrics
        self.traffic = self._open(path, half_life_seconds)
        self._gauges = {edge: metrics.traffic_rows.labels(str(edge)) for edge in LENGTH_BUCKETS}

    def _open(self, path: Path | None, half_life_seconds: float) -> Traffic:
        now = time.time()
        if path is None or not Path(path).exists():
            return Traffic(half_life_seconds, now)
        try:
            traffic = Traffic.load(path)
        except TrafficError as err:
            aside = Path(path).with_name(f"{Path(path).name}.unreadable-{int(now)}")
            Path(path).replace(aside)
            self.metrics.traffic_file_resets.inc()
            log.error("%s; kept as %s, starting from an empty traffic record", err, aside)
            return Traffic(half_life_seconds, now)
        traffic.half_life_seconds = half_life_seconds  # the flag wins over the file's
        traffic.decay_to(now)
        return traffic

    def record(self, run: BatchRun) -> None:
        if run.packed:
            self.traffic.record_packed(run.row_lengths, time.time())
        else:
            self.traffic.record(run.rows, run.seq_len, time.time())

    def publish(self) -> None:
        """Decayed rows at or below each length bucket (cumulative, as a histogram's buckets)."""
        self.traffic.decay_to(time.time())
        by_length = self.traffic.row_weights()
        for edge, gauge in self._gauges.items():
            gauge.set(sum(weight for length, weight in by_length.items() if length <= edge))

    async def save(self) -> None:
        if self.path is None:
            return
        text = self.traffic.to_json()  # on the loop: no record can interleave
        await asyncio.get_running_loop().run_in_executor(None, write_text_atomic, self.path, text)

    async def keep_saving(self, every_seconds: float, also: Callable[[], None] = lambda: None) -> None:
        """Publishes and saves every ``every_seconds``; ``also`` publishes what else is periodic."""
        while True:
            await asyncio.sleep(every_seconds)
            self.publish()
            also()
            try:
                await self.save()
            except OSError as err:  # a full or read-only disk must not stop serving
                log.error("cannot write the traffic file %s: %s", self.path, err)
