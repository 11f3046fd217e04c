# syntax=docker/dockerfile:1.7
# The CUDA image for GPU workers (`conveyor worker`). Build from the repository root:
#
#   docker build -f infra/docker/cuda.Dockerfile -t conveyor-cuda:0.2.0 .
#
# The base is NVIDIA's CUDA `base` flavour (the CUDA runtime and the environment the NVIDIA
# container toolkit reads), not `runtime`: torch's CUDA wheel ships its own cuBLAS, cuDNN and
# NCCL, and the `runtime` flavour would add the same libraries again (~2 GB). The host needs
# an NVIDIA driver new enough for the wheel's CUDA version (and, on Kubernetes, the NVIDIA
# device plugin). Versions are pinned by tag here; pin by digest in your registry mirror.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The exact versions of requirements/image-cuda.lock (`make lock`, for Ubuntu 24.04's CPython
# 3.12), every file checked against its hash: worker, triton and parquet's dependencies and
# PyPI's Linux torch, which is the CUDA build (keep CUDA_IMAGE's CUDA major version the one that
# torch wheel was built for). Then the package alone, --no-deps.
WORKDIR /src
COPY requirements/image-cuda.lock ./requirements/
RUN pip install --require-hashes --no-deps -r requirements/image-cuda.lock
COPY pyproject.toml README.md ./
COPY conveyor ./conveyor
RUN pip install --no-deps . \
    && pip check \
    && conveyor --version

FROM ${CUDA_IMAGE} AS runtime
# Triton compiles a small C launcher the first time each kernel runs: it needs a C compiler
# and the Python headers at run time, not only at build time.
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 conveyor \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/conveyor conveyor \
    && mkdir -p /cache \
    && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
# /cache holds everything a process writes: the Hugging Face model cache (HF_HOME), Triton's
# compiled kernels, other caches, and CONVEYOR_HOME (embedded defaults only). Mount a
# persistent volume there so a cold start reuses the weights and kernels of the last one.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    CONVEYOR_HOME=/cache/conveyor \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /home/conveyor
# 9090: `conveyor worker --metrics-port 9090` (metrics, and the worker's health endpoints).
EXPOSE 9090
ENTRYPOINT ["conveyor"]
CMD ["--help"]
