"""`python -m services.retrieval_server build`: corpus JSONL -> an index folder the server loads.

The folder is written under `<out>.partial/` and renamed into place at the end, with the manifest
last, so an interrupted build never leaves something that looks like an index. Passages stream
through: they go to the document store as they are read, their embeddings to a float32 scratch
file (memory-mapped, deleted afterwards), so the corpus never sits in memory as Python objects
(BM25 excepted: bm25s indexes the whole tokenised corpus at once).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import numpy as np

from services.retrieval_server.embedder import DEFAULT_EMBEDDER, Precision, Prefixes, set_threads
from services.retrieval_server.index import (
    FAISS_FILE,
    HnswParams,
    IvfPqParams,
    build_bm25,
    build_faiss_index,
    index_params,
    ivfpq_params,
)
from services.retrieval_server.store import (
    CorpusError,
    CorpusReader,
    DocStoreWriter,
    EmbedderInfo,
    IndexType,
    Manifest,
    ManifestError,
    Passage,
    read_manifest,
)

log = logging.getLogger("services.retrieval_server.build")

VECTORS_SCRATCH = "vectors.f32.tmp"


@dataclass
class BuildConfig:
    corpus: Path
    out: Path
    index_type: IndexType = "flat"
    embedder: str = DEFAULT_EMBEDDER
    batch_size: int = 64
    chunk_size: int = 1024  # passages read and embedded per step; bounds the build's memory
    precision: Precision = "float32"
    query_prefix: str | None = None
    passage_prefix: str | None = None
    hnsw: HnswParams = field(default_factory=HnswParams)
    nlist: int | None = None
    pq_m: int | None = None
    pq_nbits: int | None = None
    nprobe: int | None = None
    threads: int | None = None
    vectors_from: Path | None = None  # a flat index of the same corpus and embedder: reuse its vectors
    overwrite: bool = False
    progress: bool = True


def _chunks(passages, size: int):
    chunk: list[Passage] = []
    for passage in passages:
        chunk.append(passage)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _progress(reader: CorpusReader, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=reader.size_bytes, unit="B", unit_scale=True, desc="embedding", disable=not enabled)


def _stream_corpus(
    config: BuildConfig, reader: CorpusReader, folder: Path, embedder
) -> tuple[int, list[str]]:
    """Write the store and (dense) the scratch vectors; return the count and (BM25) the texts."""
    store = DocStoreWriter(folder)
    texts: list[str] = []
    with (folder / VECTORS_SCRATCH).open("wb") as scratch, _progress(reader, config.progress) as bar:
        for chunk in _chunks(reader, config.chunk_size):
            for passage in chunk:
                store.add(passage)
            contents = [p.contents for p in chunk]
            if embedder is None:  # BM25
                texts.extend(contents)  # bm25s needs the whole tokenised corpus at once
            elif config.vectors_from is None:
                scratch.write(embedder.encode_passages(contents, config.batch_size).tobytes())
            bar.update(reader.bytes_read - bar.n)
            bar.set_postfix(passages=len(store))
    store.close()
    if len(store) == 0:
        raise CorpusError(f"corpus {config.corpus} holds no passages")
    return len(store), texts


class ReusedEmbedder:
    """Stands in for the embedder when the vectors come from another index: its manifest's identity."""

    def __init__(self, info: EmbedderInfo) -> None:
        self.name, self.dimension, self.precision = info.name, info.dimension, info.precision
        self.prefixes = Prefixes(info.query_prefix, info.passage_prefix)


def reusable_vectors(source: Path) -> tuple[Manifest, ReusedEmbedder]:
    """A flat index whose vectors can seed another kind of index over the same corpus."""
    manifest = read_manifest(source)
    if manifest.index_type != "flat" or manifest.embedder is None:
        raise ValueError(
            f"--vectors-from needs a flat index folder; {source} holds a {manifest.index_type} index"
        )
    return manifest, ReusedEmbedder(manifest.embedder)


def copy_vectors(source: Path, scratch: Path, count: int, chunk: int = 65536) -> None:
    import faiss

    flat = faiss.read_index(str(source / FAISS_FILE))
    if flat.ntotal != count:
        raise ValueError(f"{source} holds {flat.ntotal} vectors, the corpus {count} passages")
    with scratch.open("wb") as handle:
        for start in range(0, count, chunk):
            handle.write(flat.reconstruct_n(start, min(chunk, count - start)).astype(np.float32).tobytes())


def build(config: BuildConfig, embedder=None) -> Manifest:
    """Build the index folder `config.out`; pass `embedder` to reuse a loaded one."""
    started = time.perf_counter()
    if config.out.exists() and not config.overwrite:
        raise FileExistsError(f"{config.out} exists; pass --overwrite to replace it")
    reader = CorpusReader(config.corpus)  # fails fast on a missing corpus, before any model loads
    folder = config.out.with_name(config.out.name + ".partial")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        dense = config.index_type != "bm25"
        if dense:
            set_threads(config.threads or os.cpu_count() or 1)
        source, embedder = _vector_source(config, embedder) if dense else (None, None)
        count, texts = _stream_corpus(config, reader, folder, embedder)
        if source is not None:
            if source.corpus_sha256 != reader.sha256:
                raise ValueError(f"{config.vectors_from} was built from another corpus than {config.corpus}")
            copy_vectors(config.vectors_from, folder / VECTORS_SCRATCH, count)
        params = _write_dense_index(config, folder, count, embedder.dimension) if dense else {}
        if not dense:
            build_bm25(texts, folder)
        manifest = Manifest(
            index_type=config.index_type,
            metric="inner_product" if dense else "bm25",
            count=count,
            embedder=_embedder_info(embedder) if dense else None,
            corpus_path=str(config.corpus.resolve()),
            corpus_sha256=reader.sha256,
            params=params,
            build_seconds=round(time.perf_counter() - started, 2),
        )
        (folder / VECTORS_SCRATCH).unlink()
        manifest.write(folder)  # last: a folder with a manifest is a finished index
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if config.out.exists():
        shutil.rmtree(config.out)
    folder.rename(config.out)
    return manifest


def _vector_source(config: BuildConfig, embedder) -> tuple[Manifest | None, object]:
    """(the flat index whose vectors are reused, or None; the embedder or its stand-in)."""
    if config.vectors_from is not None:
        return reusable_vectors(config.vectors_from)
    if embedder is None:
        from services.retrieval_server.embedder import Embedder

        embedder = Embedder(
            config.embedder,
            query_prefix=config.query_prefix,
            passage_prefix=config.passage_prefix,
            precision=config.precision,
        )
    return None, embedder


def _write_dense_index(config: BuildConfig, folder: Path, count: int, dimension: int) -> dict:
    import faiss

    vectors = np.memmap(folder / VECTORS_SCRATCH, dtype=np.float32, mode="r", shape=(count, dimension))
    ivfpq: IvfPqParams | None = None
    if config.index_type == "ivfpq":
        ivfpq = ivfpq_params(count, dimension, config.nlist, config.pq_m, config.pq_nbits, config.nprobe)
        log.info(f"ivfpq for {count} passages: {ivfpq}")
    index = build_faiss_index(config.index_type, vectors, config.hnsw, ivfpq)
    faiss.write_index(index, str(folder / FAISS_FILE))
    del vectors
    return index_params(config.index_type, config.hnsw, ivfpq)


def _embedder_info(embedder) -> EmbedderInfo:
    return EmbedderInfo(
        name=embedder.name,
        dimension=embedder.dimension,
        query_prefix=embedder.prefixes.query,
        passage_prefix=embedder.prefixes.passage,
        precision=embedder.precision,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.retrieval_server build",
        description="Embed a Search-R1 corpus (JSONL rows: id + contents, or id + title + text) "
        "and write an index folder.",
    )
    p.add_argument("--corpus", required=True, type=Path, help="JSONL corpus file.")
    p.add_argument("--out", required=True, type=Path, help="Index folder to write.")
    p.add_argument(
        "--index", dest="index_type", default=BuildConfig.index_type, choices=list(get_args(IndexType))
    )
    p.add_argument(
        "--embedder",
        default=BuildConfig.embedder,
        help="sentence-transformers model: hub id or local folder.",
    )
    p.add_argument(
        "--batch-size", type=int, default=BuildConfig.batch_size, help="Passages per forward pass."
    )
    p.add_argument(
        "--precision",
        default=BuildConfig.precision,
        choices=list(get_args(Precision)),
        help="Passage embedding precision (bfloat16 is 2-3x faster on CPUs with AMX).",
    )
    p.add_argument("--query-prefix", default=None, help="Default: the model family's ('query: ' for e5).")
    p.add_argument("--passage-prefix", default=None, help="Default: the model family's ('passage: ' for e5).")
    p.add_argument("--hnsw-m", type=int, default=HnswParams.m)
    p.add_argument("--ef-construction", type=int, default=HnswParams.ef_construction)
    p.add_argument("--ef-search", type=int, default=HnswParams.ef_search)
    p.add_argument("--nlist", type=int, default=None, help="IVF lists (default: 4*sqrt(N), at most N/39).")
    p.add_argument(
        "--pq-m",
        type=int,
        default=None,
        help="PQ sub-quantisers (default: ~dimension bits of code, e.g. 48 x 8 bits for 384-d).",
    )
    p.add_argument(
        "--pq-nbits", type=int, default=None, help="Bits per PQ code (default: 8; fewer below 1024 passages)."
    )
    p.add_argument("--nprobe", type=int, default=None, help="IVF lists searched (default: max(8, nlist/16)).")
    p.add_argument("--threads", type=int, default=None, help="torch/FAISS threads (default: all cores).")
    p.add_argument(
        "--vectors-from",
        type=Path,
        default=None,
        help="A flat index folder of the same corpus: reuse its vectors instead of embedding again.",
    )
    p.add_argument("--overwrite", action="store_true", help="Replace --out if it exists.")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("faiss", "sentence_transformers", "bm25s"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.batch_size < 1:
        sys.exit(f"error: --batch-size must be at least 1, got {args.batch_size}")
    hnsw = HnswParams(m=args.hnsw_m, ef_construction=args.ef_construction, ef_search=args.ef_search)
    options = {k: v for k, v in vars(args).items() if k not in ("hnsw_m", "ef_construction", "ef_search")}
    config = BuildConfig(hnsw=hnsw, **options)
    try:
        manifest = build(config)
    except (CorpusError, ManifestError, FileExistsError, ValueError, OSError) as exc:
        sys.exit(f"error: {exc}")
    print(
        f"wrote {manifest.index_type} index of {manifest.count} passages to {config.out} "
        f"in {manifest.build_seconds:.1f}s"
    )
