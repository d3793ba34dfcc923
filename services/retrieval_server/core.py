"""The retrieval-server's core: a loaded index answering a micro-batch of request slices.

`Retriever.answer(slices)` embeds every query of the batch in one call, runs one search per distinct
topk (so each answer is what that request alone would get), and writes each query's hit list by
splicing the stored passages' JSON bytes: nothing is parsed or re-encoded on the way out.
`response_body` joins a request's hit lists into its /retrieve answer.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.retrieval_server.batcher import Slice
from services.retrieval_server.index import DenseSearcher, SparseSearcher
from services.retrieval_server.store import (
    DocStore,
    Manifest,
    ManifestError,
    check_embedder_dimension,
    check_embedder_name,
    read_manifest,
)

log = logging.getLogger("services.retrieval_server")


CHARS_PER_TOKEN = 4  # English text through a WordPiece/BPE vocabulary; a cost estimate, not a count
SPARSE_MAX_COST = 1024


@dataclass(frozen=True)
class SearchJob:
    """One /retrieve request, validated."""

    queries: list[str]
    topk: int
    return_scores: bool

    @property
    def options(self) -> tuple[int, bool]:
        return (self.topk, self.return_scores)


def hits_json(store: DocStore, scores: np.ndarray, rows: np.ndarray, return_scores: bool) -> bytes:
    """One query's result list: `[{"document": {...}, "score": s}, ...]` or `[{...}, ...]`."""
    parts = []
    for score, row in zip(scores.tolist(), rows.tolist()):
        if row < 0:  # FAISS pads with -1 when it found fewer than topk
            continue
        document = store.raw(row)
        parts.append(
            b'{"document":' + document + b',"score":' + repr(score).encode() + b"}"
            if return_scores
            else document
        )
    return b"[" + b",".join(parts) + b"]"


def response_body(hit_lists: list[bytes]) -> bytes:
    """A whole /retrieve body: `{"result": [hits of query 1, hits of query 2, ...]}`."""
    return b'{"result":[' + b",".join(hit_lists) + b"]}"


class Retriever:
    """Searcher (dense or BM25) + document store. answer() runs on the batcher's worker thread."""

    def __init__(self, manifest: Manifest, searcher: DenseSearcher | SparseSearcher, store: DocStore) -> None:
        self.manifest = manifest
        self.searcher = searcher
        self.store = store
        if searcher.count != len(store):
            raise ManifestError(
                f"the index holds {searcher.count} vectors but the store {len(store)} passages"
            )

    def query_cost(self, query: str) -> int:
        """Estimated work of embedding `query`, in tokens: the embedder reads at most max_tokens."""
        return min(self.max_tokens, 2 + len(query) // CHARS_PER_TOKEN)

    @property
    def max_tokens(self) -> int:
        embedder = getattr(self.searcher, "embedder", None)
        return int(getattr(embedder, "max_tokens", 0) or SPARSE_MAX_COST)

    def answer(self, slices: list[Slice]) -> list[list[bytes]]:
        """Per slice, each query's hit list: one embed call for all queries, one search per topk."""
        encoded = self.searcher.encode([q for piece in slices for q in piece.queries])
        first_row = np.cumsum([0] + [len(piece.queries) for piece in slices])
        by_topk: dict[int, list[int]] = defaultdict(list)
        for j, piece in enumerate(slices):
            by_topk[piece.options[0]].append(j)
        answers: list[list[bytes]] = [[] for _ in slices]
        for topk, members in by_topk.items():
            rows = np.concatenate([np.arange(first_row[j], first_row[j + 1]) for j in members])
            scores, hits = self.searcher.search(_take(encoded, rows), topk)
            at = 0
            for j in members:
                return_scores = slices[j].options[1]
                for _ in slices[j].queries:
                    answers[j].append(hits_json(self.store, scores[at], hits[at], return_scores))
                    at += 1
        return answers

    def close(self) -> None:
        self.store.close()


def _take(encoded, rows: np.ndarray):
    if isinstance(encoded, np.ndarray):
        return np.ascontiguousarray(encoded[rows])
    return [encoded[i] for i in rows.tolist()]


def load_retriever(
    folder: Path,
    embedder_name: str | None = None,
    *,
    query_prefix: str | None = None,
    precision: str = "auto",
    device: str = "cpu",
    ef_search: int | None = None,
    nprobe: int | None = None,
    threads: int | None = None,
) -> Retriever:
    """Open an index folder; ManifestError if it does not fit the embedder asked for."""
    manifest = read_manifest(folder)
    check_embedder_name(manifest, embedder_name)
    store = DocStore(folder)
    if manifest.embedder is None:
        return Retriever(manifest, SparseSearcher(folder), store)
    from services.retrieval_server.embedder import Embedder, set_threads

    if threads is not None:
        set_threads(threads)
    built_with = manifest.embedder
    embedder = Embedder(
        embedder_name or built_with.name,
        query_prefix=built_with.query_prefix if query_prefix is None else query_prefix,
        passage_prefix=built_with.passage_prefix,
        precision=precision,
        device=device,
    )
    check_embedder_dimension(manifest, embedder.name, embedder.dimension)
    searcher = DenseSearcher(folder, embedder, ef_search=ef_search, nprobe=nprobe)
    if searcher.dimension != embedder.dimension:
        raise ManifestError(
            f"index.faiss holds {searcher.dimension}-d vectors, the manifest says {embedder.dimension}"
        )
    return Retriever(manifest, searcher, store)
