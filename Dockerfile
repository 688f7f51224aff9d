# syntax=docker/dockerfile:1
# elastic-train image: one image runs the controller (`etrain controller`), the node agents
# (`etrain agent`, which starts torchrun) and the chart's `helm test` pod.
#
#   CPU, the default:  docker build -t etrain:0.1.0 .
#   CUDA:              docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t etrain:0.1.0-cuda .
#
# TORCH_INDEX_URL picks the torch build: the CPU index by default; PyPI's Linux wheel is the CUDA build
# (a download.pytorch.org/whl/cuXXX index picks another CUDA version). CUDA wheels carry the CUDA runtime,
# cuDNN and NCCL as pip packages, so the slim Python base serves GPU nodes too: the node supplies the
# driver through the NVIDIA container toolkit. BASE_IMAGE swaps the base of both stages, e.g. for an
# image of your own built FROM nvidia/cuda with Python 3.11 (it must provide python3 with venv).

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and pinned, from the chosen index (CPU by default): an unpinned torch would pull CUDA wheels.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY elastic ./elastic
COPY service ./service
# The project with its service and S3 extras; the torch installed above already satisfies its pin.
# (Bytecode that pip compiles stays: it keeps `import torch` fast at every pod start.)
RUN pip install --no-cache-dir "./[service,s3]"

FROM ${BASE_IMAGE} AS runtime
LABEL org.opencontainers.image.title="elastic-train" \
      org.opencontainers.image.description="Fault-tolerant elastic training service for PyTorch (controller and node agent)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 etrain \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/etrain --create-home --shell /usr/sbin/nologin etrain
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
USER 10001:10001
WORKDIR /home/etrain
# 8080: controller API (--port); 8081: agent /healthz (--health-port); 8082: agent job logs (--logs-port).
EXPOSE 8080 8081 8082
ENTRYPOINT ["etrain"]
CMD ["--help"]
