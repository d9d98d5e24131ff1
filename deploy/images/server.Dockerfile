# dietserve server for NVIDIA GPUs: serves a prebuilt artifact (CUDA or CPU); compiles nothing.
#
#   docker build -f deploy/images/server.Dockerfile -t "$REGISTRY/dietserve-server:0.1.0" .
#
# CUDA 13: the apache-tvm 0.27 wheel's CUDA runtime links libcudart.so.13 (a CUDA 12 base cannot
# load it); the host driver must support CUDA 13 (R580 or newer). No nvcc: the artifact carries
# its kernels as a fatbin built at compile time. Python is Ubuntu 24.04's 3.12 (pyproject wants
# >= 3.11; every pinned dependency ships cp312 wheels).

# --- build: install the package into a venv, generate the protocol code into it -------------
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/dietserve
ENV PATH=/opt/dietserve/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY dietserve/ dietserve/
COPY tuner/ tuner/
# No extras: the tuner's packages (the `tune` extra) are never imported by the server. The
# protocol code is generated into the installed package (-P: /src is not on sys.path). TVM's
# compiler (libtvm_compiler.so and its sources, 285 MB) is deleted: serving loads the runtime
# library alone (TVM_USE_RUNTIME_LIB=1 below; tests/integration/test_runtime_only.py).
RUN pip install --no-cache-dir . \
    && python -P -m dietserve.server.protogen --protos /src/protos \
    && python -P -m dietserve.runtime.tvm_runtime_only --strip

# --- runtime: the venv and a Python to run it, nothing else --------------------------------
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 dietserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin dietserve
COPY --from=build /opt/dietserve /opt/dietserve
# HOME=/tmp: the root filesystem is read-only in the pod; /tmp is an emptyDir there.
ENV PATH=/opt/dietserve/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TVM_USE_RUNTIME_LIB=1
USER 10001:10001
WORKDIR /tmp
# gRPC (TLS when --tls-cert is given), Prometheus /metrics, plaintext gRPC health for probes.
EXPOSE 8001 8002 8003
ENTRYPOINT ["python", "-m", "dietserve"]
CMD ["serve", "--help"]
