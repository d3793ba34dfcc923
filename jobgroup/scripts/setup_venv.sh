#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install this checkout with the given extras.
#
#   setup_venv.sh EXTRAS        e.g. services | retrieval | trainer,sglang,loggers
#
# VENV (default ~/rl-venv) is where it goes. With the retrieval extra, CPU torch is installed first
# from PyTorch's CPU index: sentence-transformers would otherwise pull the multi-GB CUDA build onto a
# CPU node. Run from the repository root (SkyPilot's workdir).
set -euo pipefail
extras=${1:?usage: setup_venv.sh EXTRAS (e.g. services, retrieval, trainer,sglang,loggers)}
venv=${VENV:-$HOME/rl-venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
case ",$extras," in
  *,retrieval,*) "$venv/bin/python" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu ;;
esac
"$venv/bin/python" -m pip install -q -e ".[$extras]"
echo "installed .[$extras] into $venv"
