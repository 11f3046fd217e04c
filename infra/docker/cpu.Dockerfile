# syntax=docker/dockerfile:1.7
# The slim CPU image: the API server (`conveyor serve`), the migration job (`conveyor db
# upgrade`) and CPU workers (`conveyor worker`). Build from the repository root:
#
#   docker build -f infra/docker/cpu.Dockerfile -t conveyor:0.2.0 .
#
# Two stages: `build` installs the CPU torch wheel and the package into /opt/venv; the
# runtime stage copies only that venv onto a clean base (no compiler, no pip cache).
# Versions are pinned by tag here; pin by digest in your registry mirror
# (`FROM python:3.12.11-slim-bookworm@sha256:...`) for byte-identical rebuilds.

ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU wheel index: the package's `torch>=2.4` is then already met and
# pip never pulls the CUDA build (several GB) into a CPU image. The version is the Makefile's.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY conveyor ./conveyor
# The extras the package declares in pyproject.toml: `worker` (Celery, SQLAlchemy, boto3, ...)
# and `parquet` (workers ingest Parquet inputs). Add `sqs` for Amazon SQS as the broker.
ARG EXTRAS=worker,parquet
RUN pip install ".[${EXTRAS}]" \
    && conveyor --version

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 conveyor \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/conveyor conveyor \
    && mkdir -p /cache \
    && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
# /cache holds everything a process writes: the Hugging Face model cache (HF_HOME), other
# caches, and CONVEYOR_HOME (used only for the embedded defaults). Mount a volume there to keep
# downloaded weights across restarts.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    CONVEYOR_HOME=/cache/conveyor
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /home/conveyor
# 8000: `conveyor serve --port 8000`; 9090: `conveyor worker --metrics-port 9090`.
EXPOSE 8000 9090
ENTRYPOINT ["conveyor"]
CMD ["--help"]
