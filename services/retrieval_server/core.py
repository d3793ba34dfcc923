"""The retrieval-server's core: a loaded index answering a micro-batch of requests.

`Retriever.answer(jobs)` embeds every query of the batch in one call, runs one search per distinct
topk (so each answer is what that request alone would get), and writes each request's response
body by splicing the stored passages' JSON bytes: nothing is parsed or re-encoded on the way out.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


@dataclass(frozen=True)
class SearchJob:
    """One /retrieve request, validated."""

    queries: list[str]
    topk: int
    return_scores: bool


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


def response_json(store: DocStore, scores: np.ndarray, rows: np.ndarray, return_scores: bool) -> bytes:
    """A whole /retrieve body: `{"result": [hits of query 1, hits of query 2, ...]}`."""
    lists = [hits_json(store, s, r, return_scores) for s, r in zip(scores, rows)]
    return b'{"result":[' + b",".join(lists) + b"]}"


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

    def answer(self, jobs: list[SearchJob]) -> list[bytes]:
        """Response bodies for a micro-batch: one embed call for all its queries, one search per topk."""
        encoded = self.searcher.encode([q for job in jobs for q in job.queries])
        first_row = np.cumsum([0] + [len(job.queries) for job in jobs])
        by_topk: dict[int, list[int]] = defaultdict(list)
        for j, job in enumerate(jobs):
            by_topk[job.topk].append(j)
        bodies = [b""] * len(jobs)
        for topk, members in by_topk.items():
            rows = np.concatenate([np.arange(first_row[j], first_row[j + 1]) for j in members])
            scores, hits = self.searcher.search(_take(encoded, rows), topk)
            at = 0
            for j in members:
                n = len(jobs[j].queries)
                bodies[j] = response_json(
                    self.store, scores[at : at + n], hits[at : at + n], jobs[j].return_scores
                )
                at += n
        return bodies

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
