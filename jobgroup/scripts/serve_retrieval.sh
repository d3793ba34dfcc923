#!/usr/bin/env bash
# Serve the retrieval-server, first building its index when RETRIEVAL_INDEX_DIR holds none.
#
#   serve_retrieval.sh [--build-only] [extra `serve` flags...]
#
# RETRIEVAL_INDEX_DIR   the index folder (default ~/retrieval-index); an existing one (manifest.json)
#                       is reused, so a second start or a bucket-mounted index skips the build
# RETRIEVAL_CORPUS      what to index when there is no index yet: a .jsonl or .jsonl.gz path or
#                       http(s) URL of {"id", "contents"} lines (Search-R1 / FlashRAG corpus format)
# RETRIEVER_NAME        as in SkyPilot's verl search example: bm25 builds a BM25 index; any other name
#                       (e5, bge, minilm, ...) a dense FAISS index of RETRIEVAL_INDEX_TYPE
# RETRIEVAL_INDEX_TYPE  flat | hnsw | ivfpq | bm25 (default: bm25 for RETRIEVER_NAME=bm25, else flat)
# RETRIEVER_MODEL       the embedder, a hub id or folder (e.g. intfloat/e5-base-v2); RETRIEVAL_EMBEDDER
#                       is the same; default: the server's built-in MiniLM from PyPI
# RETRIEVAL_TOPK        passages per query when a request names no topk (default 3)
# RETRIEVAL_PORT        port to serve on (default 8002)
# DRY_RUN               a flag (true/false, 1/0, yes/no): print the commands instead of running them
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
index_dir=${RETRIEVAL_INDEX_DIR:-$HOME/retrieval-index}
port=${RETRIEVAL_PORT:-8002}
embedder=${RETRIEVAL_EMBEDDER:-${RETRIEVER_MODEL:-}}
default_type=flat
[ "$(printf '%s' "${RETRIEVER_NAME:-}" | tr '[:upper:]' '[:lower:]')" = bm25 ] && default_type=bm25
index_type=${RETRIEVAL_INDEX_TYPE:-$default_type}
build_only=0
[ "${1:-}" = "--build-only" ] && { build_only=1; shift; }
dry_run=0
rc=0
bash "$here/flag.sh" DRY_RUN || rc=$?
case $rc in 0) dry_run=1 ;; 2) exit 2 ;; esac

run() {  # run CMD...: or, with DRY_RUN, print it one word per line
  if [ $dry_run = 1 ]; then printf '%s\n' "$@" ""; else "$@"; fi
}

fetch_corpus() {  # $1: path or URL -> prints the path of a plain .jsonl
  local source=$1 work
  work="$(dirname "$index_dir")/corpus-download"
  mkdir -p "$work"
  case $source in
    http://*|https://*)
      echo "downloading corpus $source" >&2
      curl -fsSL --retry 3 -o "$work/corpus.download" "$source"
      source="$work/corpus.download" ;;
  esac
  [ -f "$source" ] || { echo "error: RETRIEVAL_CORPUS $source is not a file" >&2; exit 1; }
  if gzip -t "$source" 2>/dev/null; then
    gunzip -c "$source" >"$work/corpus.jsonl"
    echo "$work/corpus.jsonl"
  else
    echo "$source"
  fi
}

if [ -f "$index_dir/manifest.json" ]; then
  echo "reusing the index in $index_dir" >&2
else
  if [ -z "${RETRIEVAL_CORPUS:-}" ]; then
    echo "error: no index in $index_dir and RETRIEVAL_CORPUS is not set (a .jsonl path or URL to index)" >&2
    exit 1
  fi
  corpus=$RETRIEVAL_CORPUS
  [ $dry_run = 1 ] || corpus=$(fetch_corpus "$RETRIEVAL_CORPUS")
  run "$python" -m services.retrieval_server build --corpus "$corpus" --out "$index_dir" \
    --index "$index_type" ${embedder:+--embedder "$embedder"}
fi
[ $build_only = 1 ] && exit 0
serve=("$python" -m services.retrieval_server serve --index "$index_dir" --port "$port")
[ -n "${RETRIEVAL_TOPK:-}" ] && serve+=(--default-topk "$RETRIEVAL_TOPK")
[ $dry_run = 1 ] && { run "${serve[@]}" "$@"; exit 0; }
exec "${serve[@]}" "$@"
