#!/usr/bin/env bash
# Set up a virtual environment (CPU torch) and run the main job on the embedded offline default.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[services,retrieval,trainer,dev]"
fi
source .venv/bin/activate
exec python -m jobgroup.demo "$@"
