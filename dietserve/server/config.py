"""Server configuration: parsed once from the command line into a frozen value."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path


class ConfigError(ValueError):
    """A server setting is out of range; the message names it."""


@dataclass(frozen=True)
class ServerConfig:
    artifact: Path | None  # None until the CLI has compiled one
    model_name: str | None = None  # default: the artifact's model name
    host: str = "127.0.0.1"  # gRPC
    port: int = 8001  # 0 picks a free port
    http_port: int | None = 8000  # KServe v2 REST and OpenAI embeddings on --host; None: no HTTP
    http_body_timeout_seconds: float = 30.0  # a body that has not arrived by then is refused (408)
    metrics_host: str = "127.0.0.1"  # /metrics is for the scraper, not the clients
    metrics_port: int = 8002  # 0 picks a free port
    batching: bool = True
    max_batch_size: int = 8  # rows per model execution when batching
    max_batch_tokens: int = 2048  # a packed artifact's token budget per execution (attended tokens)
    max_queue_delay_ms: float = 2.0  # how long the oldest request waits for batch-mates
    bucket_ratio: float = 1.5  # sequence-length buckets grow by this factor: bounds padding waste
    max_queue_rows: int = 256  # rows waiting to run; beyond this requests get RESOURCE_EXHAUSTED
    max_request_bytes: int = 16 << 20
    max_response_bytes: int = 64 << 20  # bert-base's largest answer (8 x 512 tokens) is 12.6 MB
    max_concurrent_rpcs: int = 256  # RPCs handled at once, health checks aside
    threads: int | None = None  # CPU threads for the kernels (llvm artifacts)
    drain_seconds: float = 0.0  # after SIGTERM: not ready but still serving, for load balancers
    grace_seconds: float = 30.0  # after draining: how long in-flight requests may take
    tls_cert: Path | None = None  # PEM certificate chain: gRPC on --port speaks TLS
    tls_key: Path | None = None  # PEM private key of tls_cert
    tls_client_ca: Path | None = None  # PEM CA bundle: clients must present a certificate it signed
    health_port: int | None = None  # plaintext grpc.health.v1 only (Kubernetes probes cannot do TLS)
    traffic_file: Path | None = None  # executed shapes, decayed, for `dietserve tune --lengths` (runtime/traffic.py)
    traffic_half_life_seconds: float = 3600.0
    traffic_save_seconds: float = 60.0
    reflection: bool = True  # gRPC server reflection (grpcurl, Postman); off where the API should not be listed
    truncate: bool = False  # a text over the model's maximum length: truncated, or refused (the default)
    api_key_file: Path | None = None  # keys clients must present (server/auth.py reads it); None: no keys

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, f"--port {self.port} is not a TCP port"),
            (0 <= self.metrics_port <= 65535, f"--metrics-port {self.metrics_port} is not a TCP port"),
            (self.http_port is None or 0 <= self.http_port <= 65535, f"--http-port {self.http_port} is not a TCP port"),
            (self.max_batch_size >= 1, f"--max-batch-size must be at least 1, got {self.max_batch_size}"),
            (self.max_batch_tokens >= 1, f"--max-batch-tokens must be at least 1, got {self.max_batch_tokens}"),
            (self.max_queue_delay_ms >= 0, f"--max-queue-delay-ms must be >= 0, got {self.max_queue_delay_ms}"),
            (self.bucket_ratio > 1.0, f"--bucket-ratio must be above 1, got {self.bucket_ratio}"),
            (self.max_queue_rows >= 1, f"--max-queue-rows must be at least 1, got {self.max_queue_rows}"),
            (self.max_request_bytes >= 1024,
             f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}"),
            (self.max_response_bytes >= 1024,
             f"--max-response-bytes must be at least 1024, got {self.max_response_bytes}"),
            (self.max_concurrent_rpcs >= 1,
             f"--max-concurrent-rpcs must be at least 1, got {self.max_concurrent_rpcs}"),
            (self.tls_client_ca is None or self.tls_cert is not None, "--tls-client-ca needs --tls-cert and --tls-key"),
            (self.traffic_half_life_seconds > 0,
             f"--traffic-half-life-seconds must be positive, got {self.traffic_half_life_seconds}"),
            (self.traffic_save_seconds > 0,
             f"--traffic-save-seconds must be positive, got {self.traffic_save_seconds}"),
            (self.http_body_timeout_seconds > 0,
             f"--http-body-timeout-seconds must be positive, got {self.http_body_timeout_seconds}"),
            (self.threads is None or self.threads >= 1, f"--threads must be at least 1, got {self.threads}"),
            (self.drain_seconds >= 0, f"--drain-seconds must be >= 0, got {self.drain_seconds}"),
            (self.grace_seconds >= 0, f"--grace-seconds must be >= 0, got {self.grace_seconds}"),
            ((self.tls_cert is None) == (self.tls_key is None), "--tls-cert and --tls-key go together"),
            (self.health_port is None or 0 <= self.health_port <= 65535,
             f"--health-port {self.health_port} is not a TCP port"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        for name in ("tls_cert", "tls_key", "tls_client_ca", "api_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"--{name.replace('_', '-')} {path} is not a readable file")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig(artifact=None)
    group = parser.add_argument_group("server")
    for add in (_add_address_flags, _add_batching_flags, _add_limit_flags, _add_shutdown_flags,
                _add_tls_flags, _add_auth_flags, _add_traffic_flags):
        add(group, defaults)


def _add_address_flags(group: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    group.add_argument("--model-name", default=None, help="name clients use (default: the artifact's model name)")
    group.add_argument("--host", default=defaults.host,
                       help=f"address to bind gRPC and HTTP to (default {defaults.host}; 0.0.0.0 in a pod)")
    group.add_argument("--port", type=int, default=defaults.port, help=f"gRPC port (default {defaults.port}; 0: any)")
    group.add_argument("--http-port", type=int, default=defaults.http_port,
                       help=f"HTTP port: KServe v2 REST, OpenAI /v1/embeddings, TEI's /embed, /health (default "
                            f"{defaults.http_port}; 0: any)")
    group.add_argument("--no-http", dest="http_port", action="store_const", const=None,
                       help="serve gRPC only")
    group.add_argument("--http-body-timeout-seconds", type=float, default=defaults.http_body_timeout_seconds,
                       help="an HTTP request body that has not arrived in full by then gets 408, so a client that "
                            "declares more bytes than it sends cannot hold a connection (default "
                            f"{defaults.http_body_timeout_seconds:g})")
    group.add_argument("--metrics-host", default=defaults.metrics_host,
                       help=f"address to bind /metrics to (default {defaults.metrics_host}; the pod IP or 0.0.0.0 "
                            "where Prometheus scrapes it)")
    group.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                       help=f"Prometheus /metrics HTTP port (default {defaults.metrics_port}; 0: any)")
    group.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=defaults.reflection,
                       help="gRPC server reflection, which lists the services to tools such as grpcurl "
                            "(default on)")


def _add_batching_flags(group: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    group.add_argument("--no-batching", dest="batching", action="store_false",
                       help="run every request alone (default: dynamic batching)")
    group.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size,
                       help=f"most rows one model execution takes when batching (default {defaults.max_batch_size})")
    group.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens,
                       help="a packed artifact's (the CPU default) batches: most attended tokens one execution "
                            "takes, any mix of lengths, no padding; a longer request runs alone "
                            f"(default {defaults.max_batch_tokens})")
    group.add_argument("--max-queue-delay-ms", type=float, default=defaults.max_queue_delay_ms,
                       help=f"longest a request waits for batch-mates (default {defaults.max_queue_delay_ms})")
    group.add_argument("--bucket-ratio", type=float, default=defaults.bucket_ratio,
                       help="a padded artifact's sequence-length buckets grow by this factor; only lengths in one "
                            "bucket are batched together, so padding is under 1 - 1/ratio of the tokens "
                            f"(default {defaults.bucket_ratio})")
    group.add_argument("--max-queue-rows", type=int, default=defaults.max_queue_rows,
                       help=f"rows allowed to wait; more get RESOURCE_EXHAUSTED (default {defaults.max_queue_rows})")


def _add_limit_flags(group: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    group.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes,
                       help=f"largest request message (default {defaults.max_request_bytes})")
    group.add_argument("--max-response-bytes", type=int, default=defaults.max_response_bytes,
                       help="largest answer; a request whose answer would be larger gets RESOURCE_EXHAUSTED before "
                            f"it runs (default {defaults.max_response_bytes})")
    group.add_argument("--max-concurrent-rpcs", type=int, default=defaults.max_concurrent_rpcs,
                       help="calls handled at once over gRPC and HTTP together, health checks aside; more get "
                            "RESOURCE_EXHAUSTED (HTTP 429) "
                            f"(default {defaults.max_concurrent_rpcs})")
    group.add_argument("--threads", type=int, default=None,
                       help="CPU threads for the kernels (default: every CPU this process may use)")
    group.add_argument("--truncate", action=argparse.BooleanOptionalAction, default=defaults.truncate,
                       help="a text over the model's maximum length is cut to it (--truncate) or refused "
                            "(--no-truncate, the default); a request's own `truncate` parameter overrides this")


def _add_shutdown_flags(group: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    group.add_argument("--drain-seconds", type=float, default=defaults.drain_seconds,
                       help="after SIGTERM, keep serving this long while reporting not-ready (default 0)")
    group.add_argument("--grace-seconds", type=float, default=defaults.grace_seconds,
                       help=f"then wait this long for in-flight requests (default {defaults.grace_seconds})")


def _add_tls_flags(group: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    group.add_argument("--tls-cert", type=Path, default=None,
                       help="PEM certificate (chain): serve gRPC over TLS on --port (with --tls-key)")
    group.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    group.add_argument("--tls-client-ca", type=Path, default=None,
                       help="mutual TLS: PEM CA certificate(s); only clients with a certificate it signed are served")
    group.add_argument("--health-port", type=int, default=None,
                       help="also serve grpc.health.v1 alone, in plaintext, on this port (for Kubernetes gRPC "
                            "probes, which cannot speak TLS; 0: any)")


def _add_auth_flags(group: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    group.add_argument("--api-key-file", type=Path, default=defaults.api_key_file,
                       help="API keys, one per line (blank lines and # comments ignored): HTTP clients send "
                            "'Authorization: Bearer KEY', gRPC clients 'authorization' metadata 'Bearer KEY'; "
                            "health, readiness and /metrics need none (default: no keys)")


def _add_traffic_flags(group: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    group.add_argument("--traffic-file", type=Path, default=None,
                       help="record the executed shapes, decayed, in this file (written atomically every "
                            "--traffic-save-seconds and at exit; read back at start); `dietserve tune --lengths "
                            "FILE` tunes for that mix")
    group.add_argument("--traffic-half-life-seconds", type=float, default=defaults.traffic_half_life_seconds,
                       help="an execution's weight halves after this long "
                            f"(default {defaults.traffic_half_life_seconds:g})")
    group.add_argument("--traffic-save-seconds", type=float, default=defaults.traffic_save_seconds,
                       help=f"how often the traffic file is written (default {defaults.traffic_save_seconds:g})")


def config_from_args(args: argparse.Namespace, artifact: Path | None) -> ServerConfig:
    """Every flag of :func:`add_server_flags` is named after its ServerConfig field."""
    settings = {f.name: getattr(args, f.name) for f in fields(ServerConfig) if f.name != "artifact"}
    return ServerConfig(artifact=artifact, **settings)
