"""Server lifecycle: listen, load and warm up, serve, and on SIGTERM drain and exit.

    start gRPC (live, not ready) -> load artifact, warm up -> ready (v2 + grpc health SERVING)
    SIGTERM/SIGINT -> not ready -> keep serving ``drain_seconds`` -> stop accepting, finish
    in-flight requests (up to ``grace_seconds``) -> exit 0
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..model.tokenizer import TextTokenizer
from ..runtime.batcher import BatchRun, DynamicBatcher, bucket_edges
from ..runtime.engine import Engine
from ..runtime.memory import resident_bytes
from ._proto import open_inference_pb2 as pb
from .config import ServerConfig
from .metrics import ServerMetrics
from .model import TEXT_MODEL_SUFFIX, ServedModel
from .retune import RetunePolicy, RetuneSettings
from .servicer import InferenceServicer, ServingState, inference_handlers
from .status import ServingInterceptor
from .swap import HotSwap, MeasuredGain, Swapper
from .traffic_log import TrafficLog

log = logging.getLogger("dietserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# Room for a reply's framing beyond its tensors, which --max-response-bytes bounds.
REPLY_OVERHEAD_BYTES = 64 << 10
# Resident memory may exceed the figure after warm-up by this share before the VM's pooled
# buffers are released (runtime/memory.py).
MEMORY_SLACK = 0.05
RETUNE_BUCKET_RATIO = 1.5  # length buckets over which traffic drift is measured


def _record_batch(metrics: ServerMetrics, traffic: TrafficLog, gain: MeasuredGain) -> Callable[[BatchRun], None]:
    dispatch_counters = {}  # labels() costs microseconds; a model has dozens of dynamic operators

    def record(run: BatchRun) -> None:
        traffic.record(run)
        gain.record(run.rows, run.seq_len, run.compute_seconds)
        computed = run.rows * run.seq_len
        metrics.compute_duration.observe(run.compute_seconds)
        metrics.batch_size.observe(run.rows)
        metrics.computed_tokens.inc(computed)
        metrics.padding_tokens.inc(computed - run.real_tokens)
        metrics.padding_ratio.observe((computed - run.real_tokens) / computed)
        for length in run.row_lengths:
            metrics.sequence_length.observe(length)
        for operator, variant, executions in run.variants:
            counter = dispatch_counters.get((operator, variant))
            if counter is None:
                counter = dispatch_counters[(operator, variant)] = metrics.kernel_dispatch.labels(operator, variant)
            counter.inc(executions)

    return record


def _warm_up(engine: Engine, rows: int) -> int:
    """Runs a small shape and the largest batch the server forms (``rows``) at the longest
    sequence: first touch of the weights and of the planned buffers, thread pool start. Returns
    the resident bytes afterwards: what the server needs for any batch it forms. A single request
    with more rows (up to the artifact's bound) needs more while it runs; the pool is released
    after it (``runtime/memory.py``). Warming up at the artifact's own bound instead would hold
    its worst case resident for good: 4.5 GiB for MiniLM at 64 x 512."""
    import numpy as np

    for batch, seq in ((1, 8), (min(rows, engine.max_batch), engine.max_seq_len)):
        ids = np.ones((batch, min(seq, engine.max_seq_len)), np.int64)
        engine.execute(ids, np.ones_like(ids), np.zeros_like(ids))
    return resident_bytes()


def _credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not config.tls:
        return None
    client_ca = config.tls_client_ca.read_bytes() if config.tls_client_ca is not None else None
    return grpc.ssl_server_credentials([(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    return bound


async def serve(
    config: ServerConfig,
    model_name: str,
    load_model: Callable[[], tuple[Engine, TextTokenizer]],
    say: Callable[[str], None],
    stop: asyncio.Event | None = None,
    hot_swap: HotSwap | None = None,
    retune: RetuneSettings | None = None,
) -> int:
    """Serves ``model_name`` (token ids) and ``model_name-text`` (text) until ``stop`` is set
    (SIGTERM and SIGINT set it). ``say`` reports progress; the line
    ``listening grpc=HOST:PORT metrics=HOST:PORT`` gives the bound ports."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = ServerMetrics()
    traffic = TrafficLog(config.traffic_file, config.traffic_half_life_seconds, metrics)
    gain = MeasuredGain(metrics)
    text_name = model_name + TEXT_MODEL_SUFFIX
    state = ServingState(config=config, metrics=metrics, model_names=(model_name, text_name))
    server = grpc.aio.server(
        interceptors=[ServingInterceptor(metrics, config.max_concurrent_rpcs)],
        options=[
            ("grpc.max_receive_message_length", config.max_request_bytes),
            ("grpc.max_send_message_length", config.max_response_bytes + REPLY_OVERHEAD_BYTES),
            ("grpc.so_reuseport", 0),
        ])
    server.add_generic_rpc_handlers((inference_handlers(InferenceServicer(state)),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server)

    async def set_health(status) -> None:
        for service in ("", SERVICE_NAME):  # "" is the whole server, as Kubernetes probes ask
            await health_servicer.set(service, status)

    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    port = _bind(server, config.host, config.port, _credentials(config))
    await server.start()
    health_server = None
    ports = f"grpc={config.host}:{port}"
    if config.health_port is not None:
        # Probes only: the same health servicer, nothing else, without TLS.
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        ports += f" health={config.host}:{_bind(health_server, config.host, config.health_port, None)}"
        await health_server.start()
    metrics_server, metrics_port = metrics.serve_http(config.metrics_host, config.metrics_port)
    tls = (" (mutual TLS)" if config.tls_client_ca else " (TLS)") if config.tls else ""
    say(f"listening {ports} metrics={config.metrics_host}:{metrics_port}{tls}")

    def execution_stopped(err: BaseException) -> None:
        if isinstance(err, asyncio.CancelledError) or stop.is_set():
            return
        log.error("model execution stopped; reporting NOT_SERVING")
        state.ready = False
        metrics.ready.set(0)
        loop.create_task(set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    batcher = saver = watcher = policy = policy_task = None
    try:
        engine, tokenizer = await loop.run_in_executor(None, load_model)
        settled = await loop.run_in_executor(None, _warm_up, engine, config.max_batch_size)
        engine.bound_memory(int(settled * (1 + MEMORY_SLACK)))
        metrics.settled_memory.set(settled)
        if engine.pool_bound is not None:
            metrics.memory_limit.set(engine.pool_bound.limit_bytes)
            metrics.pool_releases.set_function(lambda: engine.pool_bound.releases)
        batcher = DynamicBatcher(
            engine,
            batching=config.batching,
            max_batch_size=config.max_batch_size,
            max_queue_delay_s=config.max_queue_delay_ms / 1000,
            bucket_ratio=config.bucket_ratio,
            max_queue_rows=config.max_queue_rows,
            on_queue_change=metrics.queued_rows.set,
            on_batch=_record_batch(metrics, traffic, gain),
            on_stopped=execution_stopped,
        )
        batcher.start()
        state.batcher = batcher
        state.models = {model_name: ServedModel(model_name, engine),
                        text_name: ServedModel(text_name, engine, tokenizer)}
        if hot_swap is not None:
            hot_swap.store.set_current(hot_swap.version)  # verified by serving it (restarts come back to it)
            for model in state.models.values():
                model.version = str(hot_swap.version)
            swapper = Swapper(hot_swap, batcher, state.models, metrics, traffic, gain, say)
            watcher = loop.create_task(swapper.watch(), name="dietserve-versions")
            if retune is not None:
                edges = bucket_edges(engine.max_seq_len, RETUNE_BUCKET_RATIO)
                policy = RetunePolicy(retune, hot_swap, traffic, edges, engine.max_seq_len, metrics, say)
                policy_task = loop.create_task(policy.watch(), name="dietserve-retune")
        state.ready = True
        metrics.ready.set(1)
        await set_health(health_pb2.HealthCheckResponse.SERVING)
        batching = (f"batching up to {batcher.max_batch_size} rows, {config.max_queue_delay_ms} ms delay"
                    if config.batching else "batching off")
        saver = loop.create_task(traffic.keep_saving(config.traffic_save_seconds, gain.publish),
                                 name="dietserve-traffic")
        served = f"version {hot_swap.version} of {hot_swap.store.root}; " if hot_swap is not None else ""
        say(f"ready: models '{model_name}' (token ids) and '{text_name}' (text); {served}{batching}; "
            f"{settled / 2**20:.0f} MiB resident after warm-up")
        await stop.wait()
    finally:
        state.ready = False
        metrics.ready.set(0)
        await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if stop.is_set() and config.drain_seconds > 0:
            say(f"stopping: not ready; serving {config.drain_seconds} s more while load balancers notice")
            await asyncio.sleep(config.drain_seconds)
        say("stopping: finishing in-flight requests")
        await server.stop(config.grace_seconds)
        if health_server is not None:
            await health_server.stop(0)
        for task in (watcher, policy_task):
            if task is not None:
                task.cancel()
        if policy is not None:
            policy.stop()
        if batcher is not None:
            await batcher.close()
        if saver is not None:
            saver.cancel()
        try:
            await traffic.save()
        except OSError as err:
            log.error("cannot write the traffic file %s: %s", config.traffic_file, err)
        state.decode_pool.shutdown(wait=False, cancel_futures=True)
        metrics_server.shutdown()
        # What the handlers answered: a client can tell a request the server never took (gRPC
        # cancels calls that arrive while it shuts down, before any handler sees them) from a loss.
        answered = metrics.calls_by_code("ModelInfer")
        say("stopped; ModelInfer calls answered: "
            + (", ".join(f"{code} {n}" for code, n in sorted(answered.items())) or "none"))
    return 0
