#!/usr/bin/env bash
# A Docker engine for CI and the docker tests (tests/e2e/test_compose.py, test_multinode.py): dockerd on
# the overlay2 storage driver where this kernel mounts overlays, else ../shared/tools/docker_here.sh's vfs
# engine as before; then docker_here.sh for the rest (the compose plugin, the local python:3.11-slim).
# Idempotent: an engine that already runs (either driver, or a developer's own) is kept.
#
#   bash .ci/docker_engine.sh      # prints the storage driver it ended up with
#
# Why: under vfs every container's filesystem is a full copy of its image. On CI's 2 cores creating a
# trainer container took 24 s and removing it 30 s, against 0.05 s under overlay2, and the docker tests
# peaked near 30 GB of disk (BENCHMARKS.md, "What CI costs, and two workers tried").
set -euo pipefail
docker_here="$(cd "$(dirname "$0")/.." && pwd)/../shared/tools/docker_here.sh"
log() { echo "docker_engine: $*" >&2; }

# A container's layers are overlay mounts (`create` mounts its init layer): create and remove one of an
# image of one file, imported, since nothing can be pulled here.
probe() {
  local dir id
  dir=$(mktemp -d) && echo probe >"$dir/probe" || return 1
  tar -C "$dir" -c . | docker import - docker-engine-probe:latest >/dev/null &&
    id=$(docker create docker-engine-probe:latest /probe) &&
    docker rm "$id" >/dev/null &&
    docker rmi docker-engine-probe:latest >/dev/null
  local status=$?
  rm -rf "$dir"
  return $status
}

start_overlay2() {
  if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    log "installing docker.io and debootstrap from Debian (as docker_here.sh does)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
  fi
  log "starting dockerd (overlay2 storage; log /tmp/dockerd.log)"
  setsid dockerd --storage-driver=overlay2 >/tmp/dockerd.log 2>&1 </dev/null &
  local started=$!
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$started" 2>/dev/null || break  # dockerd exits at once on a driver it cannot use
    sleep 1
  done
  local driver
  driver=$(docker info -f '{{.Driver}}' 2>/dev/null || true)
  if [ "$driver" = overlay2 ] && probe; then
    return 0
  fi
  log "overlay2 did not work (driver '${driver:-none}', log /tmp/dockerd.overlay2.log): docker_here.sh's vfs next"
  # Stop it, and wait: a second dockerd refuses to start while the first one's pid file is there.
  local pid
  pid=$(cat /var/run/docker.pid 2>/dev/null || echo "$started")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -9 "$pid" 2>/dev/null || true
  mv /tmp/dockerd.log /tmp/dockerd.overlay2.log
  return 1
}

if [ ! -f "$docker_here" ]; then
  log "$docker_here (which installs compose and the base image) is not there"
  exit 1
fi
if ! docker info >/dev/null 2>&1; then
  start_overlay2 || true
fi
bash "$docker_here"
log "storage driver: $(docker info -f '{{.Driver}}')"
