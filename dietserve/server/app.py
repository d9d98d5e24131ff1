"""Server lifecycle: listen, load and warm up, serve, and on SIGTERM drain and exit.

    start: /metrics -> traffic records -> gRPC listening (live, not ready) -> HTTP listening
           -> load and warm up every artifact -> their batchers -> hot-swap watchers -> re-tuning
           policies -> traffic savers -> ready (both wires read the same readiness)
    stop:  the same in reverse: not ready -> keep serving ``drain_seconds`` -> both wires stop
           accepting and finish in-flight requests (up to ``grace_seconds``) -> ... -> last
           traffic save -> /metrics

Each ``_start_*`` step acquires one part and registers its teardown on an ``AsyncExitStack``, so
a failure half-way through ``start`` releases exactly what was acquired, newest first.

Each artifact served has its own parts (``ServedArtifact``): engine, batcher, traffic record,
metrics labelled with its name, and, served from a version store, its own hot swap and re-tuning
policy. What they share: one execution at a time, one re-tuning job at a time, the wires.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine, Iterable, Sequence
from contextlib import AsyncExitStack

import grpc
from grpc_health.v1 import health, health_pb2

from ..host.cpu_turns import CpuTurns
from ..runtime.batcher import BatchRun, DynamicBatcher, bucket_edges
from . import grpc_server
from .batch_metrics import BatchRecorder
from .config import ServerConfig
from .grpc_server import SERVICE_NAME, TEI_SERVICES
from .http_server import HttpServer, is_inference_route
from .inference import Inference, ServingState
from .metrics import ServerMetrics
from .model import TEXT_MODEL_SUFFIX, ServedModel
from .retune import JobSlot, RetunePolicy, RetuneSettings
from .served_artifact import ModelSource, ServedArtifact, warm_up
from .swap import MeasuredGain, Swapper
from .traffic_log import TrafficLog

log = logging.getLogger("dietserve.server")

# Resident memory may exceed the figure after warm-up by this share before the VM's pooled
# buffers are released (runtime/memory.py).
MEMORY_SLACK = 0.05
RETUNE_BUCKET_RATIO = 1.5  # length buckets over which traffic drift is measured
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    (outcome,) = await asyncio.gather(task, return_exceptions=True)
    if isinstance(outcome, Exception):  # (a cancellation is a BaseException)
        log.error("background task %s had failed: %r", task.get_name(), outcome)


class Server:
    """Serves each source's artifact as ``name`` (token ids) and ``name-text`` (text), each
    artifact on its own engine and batcher, one execution at a time across them. ``say``
    reports progress; the line
    ``listening grpc=HOST:PORT [health=HOST:PORT] metrics=HOST:PORT [http=HOST:PORT]`` gives the
    bound ports. A source with a hot swap serves a version store's versions; ``retune``: each such
    source is re-tuned when its traffic drifts, one job at a time. ``stop``: an event that
    requests a stop when set (default: a new one). A name two artifacts would share, or one
    traffic file for several artifacts, raises ValueError."""

    def __init__(self, config: ServerConfig, sources: Sequence[ModelSource], say: Callable[[str], None], *,
                 retune: RetuneSettings | None = None, stop: asyncio.Event | None = None):
        if not sources:
            raise ValueError("a server needs at least one artifact to serve")
        if len(sources) > 1 and config.traffic_file is not None:
            raise ValueError("a traffic file records one artifact's traffic; several artifacts are served")
        self.config, self.sources = config, tuple(sources)
        self.say, self.retune = say, retune
        self.stop_requested = stop or asyncio.Event()
        self.metrics = ServerMetrics()
        self.state = ServingState(config=config, metrics=self.metrics,
                                  artifact_names=tuple(source.name for source in sources))
        self.core = Inference(self.state)
        self.health = health.aio.HealthServicer()
        self.ports = ""  # "grpc=HOST:PORT [health=HOST:PORT] metrics=HOST:PORT [http=HOST:PORT]" once listening
        self.artifacts: dict[str, ServedArtifact] = {}  # by name, in the sources' order, from _open_traffic
        self._settled_bytes = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: HttpServer | None = None
        self._grace = config.grace_seconds
        self._parts = AsyncExitStack()
        self._requests_finished = self._stopped = False
        self._health_updates: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ the public lifecycle

    def stop_on_signals(self, signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        """Makes :meth:`wait` return; a stop requested so drains (``drain_seconds``)."""
        self.stop_requested.set()

    async def start(self) -> None:
        """Acquires the parts in order, ready at the end. If a step fails, what the steps before it
        acquired is released (as :meth:`stop` does) and the error raised."""
        steps = (self._start_metrics, self._open_traffic, self._listen, self._listen_http, self._load,
                 self._start_batcher,
                 self._start_hot_swap, self._start_retune, self._keep_saving_traffic, self._open)
        try:
            for step in steps:
                await step()
        except BaseException:
            await self.stop()
            raise
        self._say_ready()

    async def wait(self) -> None:
        """Returns once a stop is requested."""
        await self.stop_requested.wait()

    async def stop(self, grace: float | None = None) -> None:
        """Releases the parts in reverse order: in-flight requests get ``grace`` seconds (default
        ``grace_seconds``) to finish. Then says how the inference calls were answered. Once."""
        if self._stopped:
            return
        self._stopped = True
        if grace is not None:
            self._grace = grace
        await self._parts.aclose()
        self._say_answered()

    async def run(self) -> int:
        """Starts, serves until a stop is requested, stops; 0."""
        await self.start()
        try:
            await self.wait()
        finally:
            await self.stop()
        return 0

    # ------------------------------------------------------------------ the parts, in order

    async def _start_metrics(self) -> None:
        server, port = self.metrics.serve_http(self.config.metrics_host, self.config.metrics_port)
        self._parts.callback(server.server_close)  # the port, after the serving thread stopped
        self._parts.callback(server.shutdown)
        self._metrics_address = f"{self.config.metrics_host}:{port}"

    async def _open_traffic(self) -> None:
        """Each artifact's parts, starting with its traffic record (and its file: one artifact only)."""
        config, several = self.config, len(self.sources) > 1
        for source in self.sources:
            metrics = self.metrics.for_model(source.name)
            say = (lambda message, name=source.name: self.say(f"{name}: {message}")) if several else self.say
            traffic = TrafficLog(config.traffic_file, config.traffic_half_life_seconds, metrics)
            self.artifacts[source.name] = ServedArtifact(source, metrics, traffic, MeasuredGain(metrics), say)
            self._parts.push_async_callback(self._save_traffic, traffic)

    async def _save_traffic(self, traffic: TrafficLog) -> None:
        try:
            await traffic.save()
        except OSError as err:
            log.error("cannot write the traffic file %s: %s", traffic.path, err)

    async def _listen(self) -> None:
        """gRPC up, live but not ready, and the probes' health port if configured."""
        config = self.config
        self._grpc = grpc_server.inference_server(config, self.core, self.health)
        self._parts.callback(self.state.decode_pool.shutdown, wait=False, cancel_futures=True)
        await self._set_health(NOT_SERVING)
        port = grpc_server.bind(self._grpc, config.host, config.port, grpc_server.credentials(config))
        await self._grpc.start()
        self._parts.push_async_callback(self._finish_requests)
        ports = f"grpc={config.host}:{port}"
        if config.health_port is not None:
            probes = grpc_server.probe_server(self.health)
            ports += f" health={config.host}:{grpc_server.bind(probes, config.host, config.health_port, None)}"
            await probes.start()
            self._parts.push_async_callback(probes.stop, 0)
        self.ports = f"{ports} metrics={self._metrics_address}"

    async def _listen_http(self) -> None:
        """HTTP up on the gRPC server's loop and core (same readiness), then the ports are said."""
        config = self.config
        if config.http_port is not None:
            self._http = HttpServer(self.core)
            self._parts.push_async_callback(self._finish_http)
            port = await self._http.start(config.host, config.http_port)
            self.ports += f" http={config.host}:{port}"
        tls = (" (mutual TLS)" if config.tls_client_ca else " (TLS)") if config.tls else ""
        self.say(f"listening {self.ports}{tls}")

    async def _finish_http(self) -> None:
        http, self._http = self._http, None  # once
        if http is not None:
            await http.finish(self._grace)

    async def _finish_requests(self) -> None:
        """Stops accepting calls and gives the ones in flight the grace period; once."""
        if self._requests_finished:
            return
        self._requests_finished = True
        self.say("stopping: finishing in-flight requests")
        await asyncio.gather(self._grpc.stop(self._grace), self._finish_http())

    async def _load(self) -> None:
        """Loads and warms up each artifact in turn, then bounds the VM's pool (one pool per
        process, whichever engine runs) at what they all hold after warming up."""
        loop = asyncio.get_running_loop()
        for served in self.artifacts.values():
            served.loaded, served.tokenizer = await loop.run_in_executor(None, served.source.load)
            rows = self.config.max_batch_size if self.config.batching else 1
            self._settled_bytes = await loop.run_in_executor(
                None, warm_up, served.engine, rows, self.config.max_batch_tokens)
        first, *others = (served.engine for served in self.artifacts.values())
        first.bound_memory(int(self._settled_bytes * (1 + MEMORY_SLACK)))
        for engine in others:
            engine.pool_bound = first.pool_bound
        self.metrics.settled_memory.set(self._settled_bytes)
        if first.pool_bound is not None:
            self.metrics.memory_limit.set(first.pool_bound.limit_bytes)
            self.metrics.pool_releases.set_function(lambda: first.pool_bound.releases)

    async def _start_batcher(self) -> None:
        """One batcher per artifact, sharing one execution lock: the kernels of one execution
        already use every core, so two at once would only thrash."""
        config, lock = self.config, asyncio.Lock()
        # While a re-tuning job times candidates on these CPUs, batches and timings take turns.
        turns = CpuTurns(self.retune.cpu_turns) if self.retune is not None and self.retune.cpu_turns else None
        for name, served in self.artifacts.items():
            batcher = served.batcher = DynamicBatcher(
                served.engine,
                batching=config.batching,
                max_batch_size=config.max_batch_size,
                max_queue_delay_s=config.max_queue_delay_ms / 1000,
                bucket_ratio=config.bucket_ratio,
                max_queue_rows=config.max_queue_rows,
                max_batch_tokens=config.max_batch_tokens,
                on_queue_change=served.metrics.queued_rows.set,
                on_batch=self.batch_recorder(served),
                on_stopped=self._execution_stopped,
                execution_lock=lock,
                cpu_turns=turns,
            )
            batcher.start()
            self._parts.push_async_callback(batcher.close)  # runs what is queued
            text = name + TEXT_MODEL_SUFFIX
            texts = ServedModel(text, served.engine, served.tokenizer, artifact=name, batcher=batcher)
            # (token ids are cut where texts are)
            ids = ServedModel(name, served.engine, batcher=batcher, max_input_tokens=texts.max_input_tokens)
            served.models = {name: ids, text: texts}
            self.state.models.update(served.models)

    def batch_recorder(self, served: ServedArtifact) -> Callable[[BatchRun], None]:
        """An artifact's batcher's ``on_batch``: metrics, traffic record, measured swap gain."""
        return BatchRecorder(served.metrics, served.traffic, served.gain)

    async def _start_hot_swap(self) -> None:
        for served in self.artifacts.values():
            hot_swap = served.source.hot_swap
            if hot_swap is None:
                continue
            hot_swap.store.set_current(hot_swap.version)  # verified by serving it (restarts come back to it)
            for model in served.models.values():
                model.version = str(hot_swap.version)
            swapper = Swapper(hot_swap, served.batcher, served.models, served.metrics, served.traffic, served.gain,
                              served.say)
            self._background(swapper.watch(), f"dietserve-versions-{served.name}")

    async def _start_retune(self) -> None:
        if self.retune is None:
            return
        slot = JobSlot()  # a job already uses the cores it may: two at once would only slow both
        for served in self.artifacts.values():
            if served.source.hot_swap is None:
                continue
            engine = served.engine
            edges = bucket_edges(engine.max_seq_len, RETUNE_BUCKET_RATIO)
            policy = RetunePolicy(self.retune, served.source.hot_swap, served.traffic, edges, engine.max_seq_len,
                                  served.metrics, served.say, slot)
            self._parts.callback(policy.stop)  # kills a running job
            self._background(policy.watch(), f"dietserve-retune-{served.name}")

    async def _keep_saving_traffic(self) -> None:
        for served in self.artifacts.values():
            self._background(served.traffic.keep_saving(self.config.traffic_save_seconds, served.gain.publish),
                             f"dietserve-traffic-{served.name}")

    async def _open(self) -> None:
        await self._set_ready(True)
        self._parts.push_async_callback(self._close)

    async def _close(self) -> None:
        """Not ready; on a requested stop, serves on for ``drain_seconds`` while load balancers
        notice; then takes no more calls and finishes the ones in flight."""
        await self._set_ready(False)
        drain = self.config.drain_seconds
        if self.stop_requested.is_set() and drain > 0:
            self.say(f"stopping: not ready; serving {drain} s more while load balancers notice")
            await asyncio.sleep(drain)
        await self._finish_requests()

    # ------------------------------------------------------------------ helpers

    def _background(self, coroutine: Coroutine, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._parts.push_async_callback(_cancel, task)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        # "" is the whole server, as Kubernetes probes ask; TEI's clients ask by their services' names
        for service in ("", SERVICE_NAME, *TEI_SERVICES):
            await self.health.set(service, status)

    async def _set_ready(self, ready: bool) -> None:
        self.state.ready = ready
        self.metrics.ready.set(int(ready))
        await self._set_health(SERVING if ready else NOT_SERVING)

    def _execution_stopped(self, err: BaseException) -> None:
        """The batcher's ``on_stopped``: model execution ended without a stop: not ready."""
        if isinstance(err, asyncio.CancelledError) or self.stop_requested.is_set() or self._stopped:
            return
        log.error("model execution stopped; reporting NOT_SERVING")
        self.state.ready = False
        self.metrics.ready.set(0)
        update = asyncio.get_running_loop().create_task(self._set_health(NOT_SERVING))
        self._health_updates.add(update)
        update.add_done_callback(self._health_updates.discard)

    def _say_ready(self) -> None:
        config = self.config
        rows = max(served.batcher.max_batch_size for served in self.artifacts.values())
        # (a packed artifact's batches are bounded by their tokens too)
        tokens = f" and {config.max_batch_tokens} tokens" \
            if any(served.batcher.engine.packed for served in self.artifacts.values()) else ""
        batching = (f"batching up to {rows} rows{tokens}, {config.max_queue_delay_ms} ms delay"
                    if config.batching else "batching off")
        models = ", ".join(f"'{name}' (token ids) and '{name}{TEXT_MODEL_SUFFIX}' (text){_version_said(served)}"
                           for name, served in self.artifacts.items())
        self.say(f"ready: models {models}; {batching}; "
                 f"{self._settled_bytes / 2**20:.0f} MiB resident after warm-up")

    def _say_answered(self) -> None:
        # What the handlers answered: a client can tell a request the server never took (gRPC
        # cancels calls that arrive while it shuts down, before any handler sees them) from a loss.
        def said(answered: dict[str, int]) -> str:
            return ", ".join(f"{code} {n}" for code, n in sorted(answered.items())) or "none"

        if self.config.http_port is not None:
            http = self.metrics.http_requests_by_code(is_inference_route)
            self.say(f"HTTP inference requests answered: {said(http)}")
        self.say(f"stopped; ModelInfer calls answered: {said(self.metrics.calls_by_code('ModelInfer'))}")


def _version_said(served: ServedArtifact) -> str:
    hot_swap = served.source.hot_swap
    return f", version {hot_swap.version} of {hot_swap.store.root}" if hot_swap is not None else ""


async def serve(
    config: ServerConfig,
    sources: Sequence[ModelSource],
    say: Callable[[str], None],
    stop: asyncio.Event | None = None,
    retune: RetuneSettings | None = None,
) -> int:
    """Runs a :class:`Server` until ``stop`` is set; SIGTERM and SIGINT set it."""
    server = Server(config, sources, say, retune=retune, stop=stop)
    server.stop_on_signals()
    return await server.run()
