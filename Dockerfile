# seawall: one image for every service; the command names the service, e.g.
#   docker run --rm seawall python -m services.ingress
# (compose/docker-compose.yml and deploy/k8s/ give each service its command).
#
#   docker build -t seawall .                                  # simulated engine only
#   docker build --build-arg EXTRAS=vllm -t seawall-vllm .     # with vLLM in process
#
# EXTRAS names extras of pyproject.toml, comma-separated (e.g. "vllm").
FROM python:3.11-slim

ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Only what the packages are built from (.dockerignore keeps the rest out of the
# context): the client distribution the servers build on, then the servers.
COPY client ./client
COPY pyproject.toml README.md ./
COPY seawall ./seawall
COPY services ./services

RUN pip install --no-cache-dir ./client ".${EXTRAS:+[$EXTRAS]}" \
    && groupadd --gid 10001 seawall \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin seawall \
    && mkdir -p /home/seawall/.cache \
    && chown -R 10001:10001 /home/seawall/.cache

# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
