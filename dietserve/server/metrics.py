"""Prometheus metrics, on their own registry (one per server) and their own HTTP port.

Names follow Prometheus conventions: base units (seconds), ``_total`` counters, histograms with
sub-millisecond buckets because a short request's server overhead is tens of microseconds.
What one served artifact does (its requests, batches, traffic, re-tuning and versions) carries a
``model`` label, the artifact's name (its ``-text`` model counts under it): each artifact's parts
write through :meth:`ServerMetrics.for_model`, which fills that label in.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

DURATION_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.5, 5.0, 10.0,
)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LENGTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 1024)
RATIO_BUCKETS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
MODEL = ("model",)
# The metrics labelled by model (``ModelMetrics`` binds them); the rest are the server's own.
PER_MODEL = (
    "request_duration", "queue_duration", "compute_duration", "batch_size", "sequence_length", "padding_ratio",
    "padding_tokens", "computed_tokens", "queued_rows", "kernel_dispatch", "traffic_rows", "traffic_drift",
    "retune_runs", "retune_duration", "retune_running", "retune_progress", "artifact_version", "swaps",
    "swap_failures", "checked_gain", "measured_gain", "predicted_gain", "swap_duration",
)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends
        self._add_request_metrics(r)
        self._add_batch_metrics(r)
        self._add_memory_metrics(r)
        self._add_traffic_and_retune_metrics(r)
        self._add_swap_metrics(r)

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "dietserve_requests",
            "gRPC calls by method and status code: every service (health, reflection), refusals by the "
            "concurrency cap and unknown methods included; messages over the size limit never reach the server",
            ["method", "code"], registry=r)
        self.http_requests = Counter(
            "dietserve_http_requests",
            "HTTP requests by route and status: the sibling of dietserve_requests_total for the HTTP port (unknown "
            "routes under one label); bodies over the size limit included",
            ["route", "code"], registry=r)
        self.unauthenticated = Counter(
            "dietserve_unauthenticated_requests",
            "requests refused for a missing or wrong API key (--api-key-file), by wire (grpc, http)",
            ["wire"], registry=r)
        self.request_duration = Histogram(
            "dietserve_request_duration_seconds",
            "inference time in the server (gRPC ModelInfer and HTTP infer and embeddings), from receipt to response "
            "(model=\"\": refused before a served model was named)",
            buckets=DURATION_BUCKETS, labelnames=MODEL, registry=r)
        self.queue_duration = Histogram(
            "dietserve_queue_duration_seconds", "time a request waited for its batch to start",
            buckets=DURATION_BUCKETS, labelnames=MODEL, registry=r)
        self.inflight = Gauge("dietserve_inflight_requests", "inference requests being handled (both wires)",
                              registry=r)
        self.ready = Gauge("dietserve_ready", "1 once the model is loaded and warmed up", registry=r)

    def _add_batch_metrics(self, r: CollectorRegistry) -> None:
        self.compute_duration = Histogram(
            "dietserve_compute_duration_seconds", "model execution time per batch",
            buckets=DURATION_BUCKETS, labelnames=MODEL, registry=r)
        self.batch_size = Histogram("dietserve_batch_size", "rows per model execution",
                                    buckets=SIZE_BUCKETS, labelnames=MODEL, registry=r)
        self.sequence_length = Histogram(
            "dietserve_request_sequence_length", "tokens of each computed row of a request, padding excluded",
            buckets=LENGTH_BUCKETS, labelnames=MODEL, registry=r)
        self.padding_ratio = Histogram(
            "dietserve_batch_padding_ratio", "share of a batch's computed tokens that are padding",
            buckets=RATIO_BUCKETS, labelnames=MODEL, registry=r)
        self.padding_tokens = Counter("dietserve_padding_tokens",
                                      "tokens computed only because a batch was padded", labelnames=MODEL, registry=r)
        self.computed_tokens = Counter("dietserve_computed_tokens", "tokens computed, padding included",
                                       labelnames=MODEL, registry=r)
        self.queued_rows = Gauge("dietserve_queued_rows", "rows waiting for a batch", labelnames=MODEL, registry=r)
        self.kernel_dispatch = Counter(
            "dietserve_kernel_dispatch",
            "operator executions (call sites x batches) by dynamic operator and the variant its compiled tree chose",
            ["model", "operator", "variant"], registry=r)

    def _add_memory_metrics(self, r: CollectorRegistry) -> None:
        self.settled_memory = Gauge(
            "dietserve_settled_memory_bytes",
            "resident memory after warming up at the largest batch the server forms (--max-batch-size rows of the "
            "longest sequence): process_resident_memory_bytes should stay near this",
            registry=r)
        self.memory_limit = Gauge(
            "dietserve_memory_limit_bytes",
            "resident memory past which the VM's pooled buffers are released after a batch (settled + 5%)",
            registry=r)
        self.pool_releases = Gauge("dietserve_pool_releases", "times the VM's pooled buffers were released",
                                   registry=r)

    def _add_traffic_and_retune_metrics(self, r: CollectorRegistry) -> None:
        self.traffic_rows = Gauge(
            "dietserve_traffic_rows",
            "executed rows at or below each sequence length, each execution's weight halving every "
            "--traffic-half-life-seconds (what re-tuning weights shapes by)",
            ["model", "le"], registry=r)
        self.traffic_file_resets = Counter(
            "dietserve_traffic_file_resets", "unreadable traffic files set aside at start", registry=r)
        self.traffic_drift = Gauge(
            "dietserve_traffic_drift", "total variation distance between the recorded sequence-length mix and "
            "the one the served kernels were tuned for (re-tuning starts above --retune-drift)",
            labelnames=MODEL, registry=r)
        self.retune_runs = Counter("dietserve_retune_runs", "re-tuning jobs finished, by outcome", ["model", "outcome"],
                                   registry=r)
        self.retune_duration = Gauge("dietserve_last_retune_duration_seconds", "wall time of the last re-tuning job",
                                     labelnames=MODEL, registry=r)
        self.retune_running = Gauge("dietserve_retune_running", "1 while a re-tuning job runs", labelnames=MODEL,
                                    registry=r)
        self.retune_progress = Gauge("dietserve_retune_progress", "share of the running re-tuning job's operators "
                                     "tuned (0 to 1; 1 while it compiles the tuned artifact)", labelnames=MODEL,
                                     registry=r)

    def _add_swap_metrics(self, r: CollectorRegistry) -> None:
        self.artifact_version = Gauge(
            "dietserve_artifact_version_info", "1 for the artifact version being served (hot swap; label: version)",
            ["model", "version"], registry=r)
        self.swaps = Counter("dietserve_swaps", "versions checked and swapped in", labelnames=MODEL, registry=r)
        self.swap_failures = Counter(
            "dietserve_swap_failures", "candidate versions refused: unloadable, incompatible, answering "
            "differently or measured slower (--swap-min-gain)", labelnames=MODEL, registry=r)
        self.checked_gain = Gauge(
            "dietserve_swap_checked_gain", "the last newer version's speed over the served version's, timed side "
            "by side on the traffic's heaviest shapes before swapping (below --swap-min-gain: refused)",
            labelnames=MODEL, registry=r)
        self.measured_gain = Gauge(
            "dietserve_swap_measured_gain", "compute time per shape before / after the last swap, weighted by the "
            "executions since, over shapes executed on both sides (above 1: faster)", labelnames=MODEL, registry=r)
        self.predicted_gain = Gauge(
            "dietserve_swap_predicted_gain", "what the re-tuning job that made the swapped-in version predicted: the "
            "plans' kernel time over the recorded traffic, served version / new", labelnames=MODEL, registry=r)
        self.swap_duration = Gauge("dietserve_last_swap_duration_seconds",
                                   "load + checks + swap of the last version swapped in", labelnames=MODEL, registry=r)

    def for_model(self, model: str) -> ModelMetrics:
        """The per-model metrics with ``model`` filled in (one view per artifact served)."""
        return ModelMetrics(self, model)

    def calls_by_code(self, method: str) -> dict[str, int]:
        """How many calls of ``method`` ended with each status code so far."""
        return {sample.labels["code"]: int(sample.value)
                for metric in self.requests.collect() for sample in metric.samples
                if sample.name.endswith("_total") and sample.labels["method"] == method}

    def http_requests_by_code(self, routes) -> dict[str, int]:
        """How many HTTP requests to routes for which ``routes(route)`` holds ended with each status."""
        answered: dict[str, int] = {}
        for metric in self.http_requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and routes(sample.labels["route"]):
                    code = sample.labels["code"]
                    answered[code] = answered.get(code, 0) + int(sample.value)
        return answered

    def serve_http(self, host: str, port: int) -> tuple[object, int]:
        """Starts /metrics in a daemon thread; returns (server, bound port)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port


class _WithModel:
    """A metric with labels beyond ``model``: ``labels``/``remove`` take the others."""

    def __init__(self, metric, model: str):
        self._metric, self._model = metric, model

    def labels(self, *values: str):
        return self._metric.labels(self._model, *values)

    def remove(self, *values: str) -> None:
        self._metric.remove(self._model, *values)


class ModelMetrics:
    """What one artifact's parts (batcher callback, traffic record, swapper, re-tuning policy)
    write to: the same attribute names as :class:`ServerMetrics`, the per-model ones bound to
    ``model``; any other name is the server's own metric."""

    def __init__(self, metrics: ServerMetrics, model: str):
        self.server, self.model = metrics, model
        for name in PER_MODEL:
            metric = getattr(metrics, name)
            bound = metric.labels(model) if tuple(metric._labelnames) == MODEL else _WithModel(metric, model)
            setattr(self, name, bound)

    def __getattr__(self, name: str):  # names not bound above: the server-wide metrics
        return getattr(self.server, name)
