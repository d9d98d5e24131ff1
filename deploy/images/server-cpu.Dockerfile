# dietserve server for clusters without GPUs: serves a prebuilt CPU (llvm) artifact.
#
#   docker build -f deploy/images/server-cpu.Dockerfile -t "$REGISTRY/dietserve-server-cpu:0.1.0" .
#
# An llvm artifact is compiled for one CPU (its manifest lists the CPU features it needs and
# loading refuses a host without them): compile it for the node pool it will run on.

# --- build: install the package into a venv, generate the protocol code into it -------------
FROM python:3.11.14-slim-trixie AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/dietserve
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

# --- runtime ----------------------------------------------------------------------------------
FROM python:3.11.14-slim-trixie
RUN groupadd --system --gid 10001 dietserve \
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
EXPOSE 8001 8002 8003
ENTRYPOINT ["python", "-m", "dietserve"]
CMD ["serve", "--help"]
