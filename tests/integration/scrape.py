"""Reading a running server from outside: its Prometheus metrics, and waiting for a condition.

The server records a batch's metrics one loop iteration after the callers have their answers
(``runtime/batcher.py``), so a scrape right after the last reply can miss that batch: tests that
count per-batch metrics wait for them with ``metrics_after_batches``."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from .server_process import ServerProcess


def metrics(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    """Every sample the server exposes, keyed by (name, sorted labels)."""
    text = urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (every model's, unless
    ``model=`` is given); 0 when there are none."""
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and wanted <= set(sample_labels))


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Polls ``condition`` until it holds; fails the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)


def metrics_after_batches(server: ServerProcess, batches: float, timeout: float = 10.0) -> dict:
    """``metrics(server)`` once at least ``batches`` executions are recorded in total."""
    samples = {}

    def recorded() -> bool:
        nonlocal samples
        samples = metrics(server)
        return total(samples, "dietserve_batch_size_count") >= batches

    wait_for(recorded, f"{batches:g} recorded batches", timeout)
    return samples
