# The ferrogrpc image: the coordinator (ferrogrpc coordinator) and the rank programs
# (python -m client.train) run from it, in /app; see docker-compose.yml and the README's
# compose section (tests/test_compose.py builds and runs it on a Docker engine).
#
# Layers, slowest-changing first, so that a source change rebuilds only the
# source layers (seconds, not the half minute the dependencies take): the
# user; the dependencies, read from pyproject.toml alone; then the source,
# installed without touching the dependencies.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# torch comes from this index when the base image lacks the pinned version:
# PyPI's Linux wheel pulls in gigabytes of CUDA libraries a CPU image never uses.
# A base image that has it keeps it, and its dependencies then come from the
# default index at the constrained versions (the torch index need not be
# reachable: a base built where it is not may hold other versions of them).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin ferrogrpc

WORKDIR /src
# The README's constraints file pins what the tests ran against (torch among
# them); the dependency floors themselves come from pyproject.toml.
COPY pyproject.toml constraints.txt ./
RUN set -eu; \
    python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
print(*p['build-system']['requires'], *p['project']['dependencies'], sep='\n')" > requirements.txt; \
    constraints=""; if [ -f constraints.txt ]; then constraints="-c constraints.txt"; fi; \
    torch_req="$(grep '^torch\b' requirements.txt)"; \
    pinned="$(sed -n 's/^torch==//p' constraints.txt 2>/dev/null || true)"; \
    if [ -n "$pinned" ] && python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$pinned')" 2>/dev/null; then \
        echo "torch $pinned is in the base image"; \
    else \
        pip install -q $constraints --index-url "$TORCH_INDEX_URL" "$torch_req"; \
    fi; \
    pip install -q $constraints -r requirements.txt

COPY README.md ./
COPY ferrogrpc ferrogrpc
# --no-build-isolation: setuptools is already installed above, so building
# the package needs no index; --no-deps: nor does installing it. Only the
# library is installed: client/ holds programs, not a package.
RUN pip install -q --no-deps --no-build-isolation . && rm -rf /src/build

# The rank programs' folder: `python -m client.train` runs from it, and imports
# the installed ferrogrpc (there is no ferrogrpc/ here). The coordinator and its
# healthcheck are the installed `ferrogrpc coordinator` and `ferrogrpc health`.
WORKDIR /app
COPY client client
USER ferrogrpc

# 29400: coordinator (gRPC rendezvous + grpc.health.v1); 29500: a rank's peer.
EXPOSE 29400 29500
CMD ["ferrogrpc", "--help"]
