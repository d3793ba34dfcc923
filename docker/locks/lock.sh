#!/usr/bin/env bash
# Regenerate the lock files that the images install from: one per extra set, every package pinned, so
# two builds of an image get the same packages. Run from anywhere, then commit docker/locks/*.txt:
#
#   bash docker/locks/lock.sh
#
# Each Dockerfile installs its lock with `pip install --no-deps -r`, so a package missing from a lock is
# missing from the image: rerun this after any change to pyproject.toml's dependencies
# (tests/e2e/test_compose.py fails until the locks satisfy pyproject.toml again).
#
# torch: the CPU sets pin PyTorch's CPU build (2.13.0+cpu, from https://download.pytorch.org/whl/cpu;
# where that index is unreachable, TORCH_WHEELS=DIR names a folder holding the wheel). The CUDA sets pin
# PyPI's torch 2.10.0, the last whose PyPI wheel targets CUDA 12.8, the trainer base image's CUDA.
# uv comes from UV (a path) or PATH, else it is installed into a throwaway virtual environment.
set -euo pipefail
cd "$(dirname "$0")/../.."

TORCH_CPU=2.13.0+cpu
TORCH_CUDA=2.10.0
UV_VERSION=0.13.9
PLATFORM=x86_64-manylinux_2_28

uv=${UV:-$(command -v uv || true)}
if [ -z "$uv" ]; then
  venv=$(mktemp -d)
  trap 'rm -rf "$venv"' EXIT
  python3 -m venv "$venv" && "$venv/bin/pip" install -q "uv==$UV_VERSION"
  uv=$venv/bin/uv
fi
constraints=$(mktemp -d)

# lock NAME PYTHON TORCH EXTRA...   (TORCH: none | cpu | cuda)
lock() {
  local name=$1 python=$2 torch=$3 source=()
  shift 3
  : >"$constraints/$name.txt"
  case $torch in
    cpu)
      echo "torch==$TORCH_CPU" >"$constraints/$name.txt"
      if [ -n "${TORCH_WHEELS:-}" ]; then
        source=(--find-links "$TORCH_WHEELS")
      else
        source=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
      fi ;;
    cuda) echo "torch==$TORCH_CUDA" >"$constraints/$name.txt" ;;
  esac
  "$uv" pip compile pyproject.toml "${@/#/--extra=}" --quiet \
    --python-version "$python" --python-platform "$PLATFORM" \
    --constraint "$constraints/$name.txt" "${source[@]}" \
    --custom-compile-command "bash docker/locks/lock.sh" \
    --output-file "docker/locks/$name.txt"
  # the constraint file lives in a temporary folder: name it by its role, so a rerun changes no line
  sed -i "s#-c $constraints/#-c torch-constraint/#" "docker/locks/$name.txt"
  echo "docker/locks/$name.txt: $(grep -c '==' "docker/locks/$name.txt") packages"
}

# The services image (python:3.11-slim, Python 3.11): data-server and reward-server, no torch.
lock services 3.11 none services
# The same Dockerfile with LOCK=retrieval / reward-model / reward-model-cpu.
lock retrieval 3.11 cpu retrieval
lock reward-model 3.11 cuda reward-model
lock reward-model-cpu 3.11 cpu reward-model
# The trainer image: CUDA base (Ubuntu 22.04, Python 3.10), or python:3.11-slim for the CPU variant.
lock trainer-cuda 3.10 cuda trainer sglang loggers
lock trainer-cpu 3.11 cpu trainer
rm -rf "$constraints"
