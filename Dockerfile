# atoll learner / training-run image: CUDA-enabled torch, atoll installed, runs as a non-root user.
#
#   docker build -t atoll:latest .
#   docker run --rm --gpus all atoll:latest atoll learner --help
#
# Prefect's docker and kubernetes workers start flow runs in it with their default command
# (`prefect flow-run execute`); the deployments use module entrypoints, so nothing is pulled.
# The base image already holds torch (built for CUDA 12.8): `pip install .` keeps it, since
# atoll asks for torch>=2.4. Pick another base with --build-arg BASE_IMAGE=... (e.g. a newer
# pytorch/pytorch:<version>-cuda<x.y>-cudnn9-runtime tag that matches your drivers).
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/atoll
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install . \
    && python -c "import atoll.flows.learner, torch; print('atoll on torch', torch.__version__, 'cuda', torch.version.cuda)"

# Numeric uid/gid: Kubernetes can then prove runAsNonRoot without resolving a user name.
RUN groupadd --gid 10001 atoll && useradd --uid 10001 --gid 10001 --create-home --shell /bin/bash atoll
USER 10001:10001
WORKDIR /home/atoll
ENV HOME=/home/atoll \
    PREFECT_HOME=/home/atoll/.prefect

CMD ["atoll", "--help"]
