"""Index kinds, their parameters, and the searchers that serve them.

- flat:  exact inner product (IndexFlatIP). 4·d bytes a passage; search time grows with the corpus.
- hnsw:  graph search (IndexHNSWFlat). Flat's memory plus the graph; ms per query at 1M vectors,
         ef_search trades time for recall; slow to build (16 min for 1M x 384 on 2 shared cores).
- ivfpq: inverted lists of product-quantised residuals (IndexIVFPQ). ~d/8 bytes a passage, approximate.
- bm25:  sparse lexical scores (bm25s); no embedder at all.

IVF-PQ must be trained, so its sizes follow the corpus (`ivfpq_params`):
- nlist = 4·sqrt(N), but at most N/39: FAISS's k-means wants ~39 points per coarse centroid.
- PQ codebooks of 2^8 entries once there are 4 points per entry (N >= 1024), fewer bits below
  (min 4). Fewer than 39 points per entry is fine here: on a small corpus the training set *is*
  the corpus, so a codebook fitted closely to it is what we want. On SQuAD dev (2067 passages)
  8-bit codes gave recall@1/@5 0.59/0.85 against 0.55/0.82 for the "39 points" choice of 5 bits.
- about d bits of code per vector whatever the bits per code (d/8 sub-quantisers at 8 bits,
  d/5 at 5 bits), so a tiny corpus's coarser codebooks are made up for by more of them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FAISS_FILE = "index.faiss"
BM25_DIR = "bm25"
POINTS_PER_CENTROID = 39  # FAISS warns below this many training points per k-means centroid
POINTS_PER_CODEWORD = 4  # PQ codebooks: enough when the training set is the corpus (see above)
MIN_PQ_BITS = 4
MAX_PQ_BITS = 8


@dataclass(frozen=True)
class HnswParams:
    m: int = 32  # graph degree: recall and memory both grow with it
    ef_construction: int = 80
    ef_search: int = 64


@dataclass(frozen=True)
class IvfPqParams:
    nlist: int
    pq_m: int
    pq_nbits: int
    nprobe: int
    train_size: int


def ivfpq_params(
    count: int,
    dimension: int,
    nlist: int | None = None,
    pq_m: int | None = None,
    pq_nbits: int | None = None,
    nprobe: int | None = None,
) -> IvfPqParams:
    """IVF-PQ sizes that FAISS can train on `count` vectors (any given value wins)."""
    if nlist is None:
        nlist = max(1, min(round(4 * math.sqrt(count)), count // POINTS_PER_CENTROID))
    if pq_nbits is None:
        affordable = math.floor(math.log2(max(2, count / POINTS_PER_CODEWORD)))
        pq_nbits = min(MAX_PQ_BITS, max(MIN_PQ_BITS, affordable))
    if pq_m is None:
        # About `dimension` bits of code per vector: 48 sub-quantisers x 8 bits for 384-d MiniLM.
        target = max(1, dimension // pq_nbits)
        pq_m = max(m for m in range(1, target + 1) if dimension % m == 0)
    if dimension % pq_m:
        raise ValueError(f"pq_m={pq_m} must divide the dimension {dimension}")
    if nprobe is None:
        # Search every list of a small index; about 1/16 of a large one's, at least 8.
        nprobe = min(nlist, max(8, nlist // 16))
    centroids_needing_points = max(nlist, 2**pq_nbits)
    train_size = min(count, max(64 * nlist, POINTS_PER_CENTROID * centroids_needing_points))
    return IvfPqParams(
        nlist=nlist, pq_m=pq_m, pq_nbits=pq_nbits, nprobe=min(nprobe, nlist), train_size=train_size
    )


def _add_in_chunks(index, vectors: np.ndarray, chunk: int = 65536) -> None:
    for start in range(0, len(vectors), chunk):
        index.add(np.ascontiguousarray(vectors[start : start + chunk], dtype=np.float32))


def build_faiss_index(
    kind: str, vectors: np.ndarray, hnsw: HnswParams, ivfpq: IvfPqParams | None, seed: int = 0
):
    """A filled FAISS index over `vectors` (N x d, L2-normalised; may be a memmap)."""
    import faiss

    count, dimension = vectors.shape
    if kind == "flat":
        index = faiss.IndexFlatIP(dimension)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dimension, hnsw.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = hnsw.ef_construction
        index.hnsw.efSearch = hnsw.ef_search
    elif kind == "ivfpq":
        assert ivfpq is not None
        quantizer = faiss.IndexFlatIP(dimension)
        index = faiss.IndexIVFPQ(
            quantizer, dimension, ivfpq.nlist, ivfpq.pq_m, ivfpq.pq_nbits, faiss.METRIC_INNER_PRODUCT
        )
        # Tiny corpora get fewer points per centroid than FAISS likes; ivfpq_params chose that knowingly.
        index.cp.min_points_per_centroid = 1
        index.pq.cp.min_points_per_centroid = 1
        sample = np.random.default_rng(seed).choice(count, size=ivfpq.train_size, replace=False)
        index.train(np.ascontiguousarray(vectors[np.sort(sample)], dtype=np.float32))
        index.nprobe = ivfpq.nprobe
    else:
        raise ValueError(f"unknown FAISS index kind {kind!r}")
    _add_in_chunks(index, vectors)
    return index


def index_params(kind: str, hnsw: HnswParams, ivfpq: IvfPqParams | None) -> dict:
    if kind == "hnsw":
        return asdict(hnsw)
    if kind == "ivfpq" and ivfpq is not None:
        return asdict(ivfpq)
    return {}


class DenseSearcher:
    """Embed queries, then one FAISS search per distinct topk."""

    def __init__(
        self, folder: Path, embedder, ef_search: int | None = None, nprobe: int | None = None
    ) -> None:
        import faiss

        self.index = faiss.read_index(str(folder / FAISS_FILE))
        self.embedder = embedder
        if ef_search is not None and hasattr(self.index, "hnsw"):
            self.index.hnsw.efSearch = ef_search
        if nprobe is not None and hasattr(self.index, "nprobe"):
            self.index.nprobe = nprobe

    @property
    def dimension(self) -> int:
        return int(self.index.d)

    @property
    def count(self) -> int:
        return int(self.index.ntotal)

    def encode(self, queries: list[str]) -> np.ndarray:
        return self.embedder.encode_queries(queries)

    def search(self, encoded: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), both nq x topk; rows of -1 mark missing hits (an IVF list ran dry)."""
        return self.index.search(encoded, topk)


class SparseSearcher:
    """BM25 over the same passages; "encoding" a query is tokenising it."""

    def __init__(self, folder: Path) -> None:
        import bm25s

        self.retriever = bm25s.BM25.load(str(folder / BM25_DIR), mmap=True, show_progress=False)
        self._count = int(self.retriever.scores["num_docs"])

    @property
    def count(self) -> int:
        return self._count

    def encode(self, queries: list[str]) -> list[list[str]]:
        return tokenize(queries)

    def search(self, encoded: list[list[str]], topk: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(topk, self._count)
        # numpy's top-k, never JAX's: bm25s picks JAX where it is installed (GPU images), and JAX takes
        # 75% of a GPU's memory when it starts, memory the trainer beside this service then lacks
        rows, scores = self.retriever.retrieve(
            encoded, k=k, show_progress=False, n_threads=0, backend_selection="numpy"
        )
        return scores.astype(np.float32), rows.astype(np.int64)


def tokenize(texts: list[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


def build_bm25(texts: list[str], folder: Path) -> None:
    import bm25s

    retriever = bm25s.BM25()
    retriever.index(tokenize(texts), show_progress=False)
    retriever.save(str(folder / BM25_DIR), show_progress=False)
