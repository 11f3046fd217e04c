# syntax=docker/dockerfile:1.7
# The slim CPU image: the API server (`conveyor serve`), the migration job (`conveyor db
# upgrade`) and CPU workers (`conveyor worker`). Build from the repository root:
#
#   docker build -f infra/docker/cpu.Dockerfile -t conveyor:0.2.0 .
#
# Two stages: `build` installs the CPU torch wheel and the package into /opt/venv; the
# runtime stage copies only that venv onto a clean base (no compiler, no pip cache).
# Versions are pinned by tag here; pin by digest in your registry mirror
# (`FROM python:3.11.14-slim-bookworm@sha256:...`) for byte-identical rebuilds. CPython 3.11: the
# Python requirements/image-cpu.lock is resolved for.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The exact versions of requirements/image-cpu.lock (`make lock`), every file checked against
# its hash: worker and parquet's dependencies and torch's CPU build, which PyTorch's CPU index
# serves (PyPI's Linux torch is the multi-GB CUDA build). Then the package alone, --no-deps. For
# other extras (`sqs`), add them to requirements/lock.sh and run `make lock`.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY requirements/image-cpu.lock ./requirements/
RUN pip install --require-hashes --no-deps --extra-index-url "${TORCH_INDEX_URL}" -r requirements/image-cpu.lock
COPY pyproject.toml README.md ./
COPY conveyor ./conveyor
RUN pip install --no-deps . \
    && pip check \
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
