#!/usr/bin/env bash
# What the compose tests (tests/test_compose.py) need on this host, each step
# skipped when already there: Debian's docker.io and docker-compose, a running
# Docker engine, and the base image python:3.11-slim. The README's test command
# runs it; run it as root on Debian (docs/troubleshooting.md, "docker compose").
#
# The base image is pulled where Docker Hub answers. Where it does not, it is
# built here instead: a Debian bookworm root filesystem (Debian's Python is
# 3.11 there) made by debootstrap from the apt mirror this host already uses,
# imported into Docker, with `python` and `pip` where python:3.11-slim has
# them, this host's CA bundle (so that pip inside reaches the index this host
# reaches), and, when pip's find-links here hold the torch wheel that
# constraints.txt pins, that wheel installed (the Dockerfile then skips its
# torch download).
#
# FERROGRPC_BASE_IMAGE names the image to provide (default python:3.11-slim);
# FERROGRPC_BASE_PULL=0 builds it without trying Docker Hub.
set -euo pipefail

image=${FERROGRPC_BASE_IMAGE:-python:3.11-slim}
suite=bookworm
root_dir=$(cd "$(dirname "$0")/.." && pwd)

say() { echo "docker_setup: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts dockerd)"

install_missing() {
  # install_missing COMMAND PACKAGE ...: apt-get install each PACKAGE whose
  # COMMAND is not on PATH.
  local wanted=()
  while [ $# -gt 1 ]; do
    command -v "$1" >/dev/null || wanted+=("$2")
    shift 2
  done
  [ ${#wanted[@]} -eq 0 ] && return 0
  say "installing ${wanted[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${wanted[@]}" >/dev/null
}

start_engine() {
  docker info >/dev/null 2>&1 && return 0
  if [ -d /run/systemd/system ]; then
    say "starting docker (systemctl)"
    systemctl start docker || true
  else
    say "starting dockerd (log: /var/log/ferrogrpc-dockerd.log)"
    setsid dockerd >/var/log/ferrogrpc-dockerd.log 2>&1 < /dev/null &
  fi
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && return 0
    sleep 1
  done
  die "the Docker engine did not answer within 60 s (see /var/log/ferrogrpc-dockerd.log)"
}

apt_mirror() {
  # The Debian mirror this host's apt uses for the suite, as apt itself
  # reports it (deb822 .sources and sources.list alike).
  apt-get indextargets --format '$(REPO_URI) $(CODENAME)' 2>/dev/null \
    | awk -v s="$suite" '$2 == s { print $1; exit }'
}

torch_wheel() {
  # The torch wheel constraints.txt pins, from pip's find-links on this
  # host, for CPython 3.11 on Linux; nothing if there is none.
  local pin links dir
  pin=$(sed -n 's/^torch==//p' "$root_dir/constraints.txt" 2>/dev/null || true)
  [ -n "$pin" ] || return 0
  links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
  for dir in $links; do
    dir=${dir#file://}
    [ -d "$dir" ] || continue
    ls "$dir"/torch-"$pin"*-cp311-cp311-*linux*_"$(uname -m)".whl 2>/dev/null | head -n 1
  done | head -n 1
}

build_base() {
  local mirror work wheel
  install_missing debootstrap debootstrap
  mirror=$(apt_mirror)
  [ -n "$mirror" ] || mirror=http://deb.debian.org/debian/
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  say "building $image: Debian $suite from $mirror (a few minutes)"
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    "$suite" "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
  tar -C "$work/rootfs" -c . | docker import - "ferrogrpc-rootfs:$suite" >/dev/null
  mkdir "$work/context"
  cp /etc/ssl/certs/ca-certificates.crt "$work/context/ca-certificates.crt"
  wheel=$(torch_wheel)
  {
    echo "FROM ferrogrpc-rootfs:$suite"
    echo "COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt"
    # Debian's Python is "externally managed": pip may install into it here,
    # as it does in python:3.11-slim.
    echo "ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
      "PIP_DISABLE_PIP_VERSION_CHECK=1"
    echo "RUN ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip"
    if [ -n "$wheel" ]; then
      cp "$wheel" "$work/context/"
      echo "COPY $(basename "$wheel") /tmp/"
      echo "RUN pip install --no-cache-dir /tmp/$(basename "$wheel") && rm /tmp/*.whl"
    fi
    echo 'CMD ["python"]'
  } >"$work/context/Dockerfile"
  docker build -t "$image" "$work/context" >"$work/build.log" 2>&1 \
    || { tail -n 20 "$work/build.log" >&2; die "building $image failed"; }
  docker image rm "ferrogrpc-rootfs:$suite" >/dev/null 2>&1 || true
  say "built $image${wheel:+ (with $(basename "$wheel"))}"
}

install_missing docker docker.io dockerd docker.io docker-compose docker-compose
start_engine
if docker image inspect "$image" >/dev/null 2>&1; then
  exit 0
fi
if [ "${FERROGRPC_BASE_PULL:-1}" != 0 ] && timeout 120 docker pull -q "$image" >/dev/null 2>&1; then
  say "pulled $image"
  exit 0
fi
build_base
