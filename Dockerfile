# The ferrogrpc image: the coordinator (python -m server) and rank programs
# (python -m client.train) run from it; see docker-compose.yml.
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY ferrogrpc ferrogrpc
COPY client client
COPY server server
RUN pip install .

# 29400: coordinator (gRPC rendezvous + grpc.health.v1); 29500: a rank's peer.
EXPOSE 29400 29500
CMD ["ferrogrpc", "--help"]
