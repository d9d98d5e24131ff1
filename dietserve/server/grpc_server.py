"""Building the gRPC servers: the inference server (interceptor, message limits, the v2 service,
TEI's services, health, reflection, TLS) and the plaintext health-only server for Kubernetes probes."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ._proto import open_inference_pb2 as pb
from .config import ServerConfig
from .inference import Inference
from .servicer import InferenceServicer, inference_handlers
from .status import ServingInterceptor
from .tei_grpc import SERVICES as TEI_SERVICES
from .tei_grpc import add_tei_services

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Room for a reply's framing beyond its tensors, which --max-response-bytes bounds.
REPLY_OVERHEAD_BYTES = 64 << 10


def inference_server(config: ServerConfig, core: Inference,
                     health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    """The v2 inference service and TEI's services over ``core``, with ``health_servicer`` and,
    if configured, reflection; not bound yet."""
    server = grpc.aio.server(
        interceptors=[ServingInterceptor(core.state.metrics, core.state.cap, core.state.api_keys)],
        options=[
            ("grpc.max_receive_message_length", config.max_request_bytes),
            ("grpc.max_send_message_length", config.max_response_bytes + REPLY_OVERHEAD_BYTES),
            ("grpc.so_reuseport", 0),
        ])
    server.add_generic_rpc_handlers((inference_handlers(InferenceServicer(core)),))
    add_tei_services(server, core)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        reflection.enable_server_reflection([SERVICE_NAME, *TEI_SERVICES, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME],
                                           server)
    return server


def probe_server(health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    """The same health servicer and nothing else, served without TLS: Kubernetes gRPC probes
    cannot present a client certificate."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server


def credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not config.tls:
        return None
    client_ca = config.tls_client_ca.read_bytes() if config.tls_client_ca is not None else None
    return grpc.ssl_server_credentials([(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Binds ``host:port`` (0: any free port); returns the bound port."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    return bound
