"""Build time, memory and search latency of flat, HNSW and IVF-PQ at 1M x 384 (random vectors).

For choosing an index for wiki-18-sized corpora (21M passages). Each index is built with the
server's own parameter choices (services.retrieval_server.index) and written to disk; then a fresh
subprocess loads it (so its resident memory is what serving it costs) and times searches with the
thread count the server would use: one query at a time (p50/p99), and batches of 32.

Random unit vectors have no cluster structure: every vector is about as far from a random query as
every other, the worst case for HNSW and IVF-PQ, so their recall@10 against exact search on random
queries is a pessimistic bound. Queries planted near a stored vector (cosine 0.8, about a real
question's best passage) show whether an index finds a clear best match: planted@10 is the share
of those whose vector is in the top 10. Retrieval quality on real questions is
bench/retrieval_quality.py's.

`store` (in --kinds by default) measures the document store the same way: 1M synthetic passages
written with the build's DocStoreWriter, opened by a fresh process that then fetches 20000 random
passages; against it, the memory of the same passages loaded as Python dicts, the way a server
that keeps its corpus in a list would hold them.

    .venv/bin/python bench/retrieval_scale.py [--count 1000000] [--dim 384] [--kinds flat hnsw ivfpq]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.retrieval_server.embedder import default_threads, set_threads
from services.retrieval_server.index import HnswParams, build_faiss_index, ivfpq_params
from services.retrieval_server.store import DocStore, DocStoreWriter, Passage

QUERIES = 200
TOPK = 10
STORE_FETCHES = 20_000


def unit_vectors(count: int, dim: int, seed: int, chunk: int = 100_000) -> np.ndarray:
    out = np.empty((count, dim), dtype=np.float32)
    rng = np.random.default_rng(seed)
    for start in range(0, count, chunk):
        block = rng.standard_normal((min(chunk, count - start), dim), dtype=np.float32)
        out[start : start + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def rss_mb(kind: str = "VmRSS") -> float:
    """Resident memory (VmRSS), or its anonymous (RssAnon) or file-backed (RssFile) part, in MB."""
    with open("/proc/self/status") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return int(fields[kind].split()[0]) / 1024


def build(kind: str, vectors: np.ndarray, folder: Path) -> dict:
    import faiss

    set_threads(os.cpu_count() or 1)  # builds use every core, as the build CLI does
    params = ivfpq_params(*vectors.shape) if kind == "ivfpq" else None
    started = time.perf_counter()
    index = build_faiss_index(kind, vectors, HnswParams(), params)
    seconds = time.perf_counter() - started
    path = folder / f"{kind}.faiss"
    faiss.write_index(index, str(path))
    return {
        "index": kind,
        "build_s": round(seconds, 1),
        "file_mb": round(path.stat().st_size / 2**20, 1),
        "params": params.__dict__ if params else (HnswParams().__dict__ if kind == "hnsw" else {}),
    }


def planted_queries(
    vectors: np.ndarray, count: int, cosine: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Queries at `cosine` from randomly chosen stored vectors, and those vectors' rows."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(vectors), size=count, replace=False)
    noise = rng.standard_normal((count, vectors.shape[1])).astype(np.float32)
    noise *= math.sqrt(1 / cosine**2 - 1) / np.linalg.norm(noise, axis=1, keepdims=True)  # |x|=1, x ⟂ noise
    queries = vectors[rows] + noise
    return queries / np.linalg.norm(queries, axis=1, keepdims=True), rows


def measure(path: Path) -> dict:
    """Runs in a fresh process: memory of the loaded index, search latency, recall vs exact."""
    import faiss

    set_threads(default_threads())
    folder = path.parent
    queries = np.load(folder / "queries.npy")
    before = rss_mb()
    index = faiss.read_index(str(path))
    loaded_mb = rss_mb() - before
    single = []
    for q in queries:
        started = time.perf_counter()
        index.search(q[None, :], TOPK)
        single.append(time.perf_counter() - started)
    started = time.perf_counter()
    rows = np.concatenate([index.search(queries[s : s + 32], TOPK)[1] for s in range(0, len(queries), 32)])
    batch_ms_per_query = 1e3 * (time.perf_counter() - started) / len(queries)
    single.sort()
    result = {
        "rss_mb": round(loaded_mb, 1),
        "p50_ms": round(1e3 * single[len(single) // 2], 2),
        "p99_ms": round(1e3 * single[int(0.99 * len(single))], 2),
        "batch32_ms_per_query": round(batch_ms_per_query, 3),
        "threads": default_threads(),
    }
    if path.name == "flat.faiss":
        np.save(folder / "flat.truth.npy", rows)
    truth = np.load(folder / "flat.truth.npy")
    result["recall@10_vs_flat"] = round(
        float(np.mean([len(set(a) & set(b)) / TOPK for a, b in zip(rows, truth)])), 3
    )
    _, found = index.search(np.load(folder / "planted.npy"), TOPK)
    planted = np.load(folder / "planted_rows.npy")
    result["planted@10"] = round(float(np.mean([p in row for p, row in zip(planted, found)])), 3)
    return result


def write_store(count: int, folder: Path) -> dict:
    """1M passages of about wiki-18's length (~100 words), written as the build writes them."""
    words = [
        "river",
        "composer",
        "volcano",
        "island",
        "century",
        "empire",
        "treaty",
        "season",
        "album",
        "league",
    ]
    writer = DocStoreWriter(folder)
    started = time.perf_counter()
    for i in range(count):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(100))
        writer.add(Passage(id=str(i), contents=f'"Title {i}"\n{text}'))
    writer.close()
    size_mb = sum(p.stat().st_size for p in folder.glob("doc*")) / 2**20
    return {
        "index": "store",
        "build_s": round(time.perf_counter() - started, 1),
        "file_mb": round(size_mb, 1),
    }


def measure_store(folder: Path) -> dict:
    """Fresh process: memory of the opened store and of 20000 random fetches, then of a dict list.

    Fetched passages stay mapped as file-backed pages (RssFile): page cache the kernel can drop and
    that processes share. A list of dicts is anonymous memory (RssAnon), the process's own.
    """
    import json

    anon, file = rss_mb("RssAnon"), rss_mb("RssFile")
    store = DocStore(folder)
    opened_mb = rss_mb("RssAnon") - anon + rss_mb("RssFile") - file
    rows = np.random.default_rng(0).integers(0, len(store), STORE_FETCHES)
    started = time.perf_counter()
    for row in rows.tolist():
        store.raw(row)
    fetch_us = 1e6 * (time.perf_counter() - started) / STORE_FETCHES
    fetched_anon, fetched_file = rss_mb("RssAnon") - anon, rss_mb("RssFile") - file
    store.close()
    anon = rss_mb("RssAnon")
    with (folder / "docs.jsonl").open() as handle:
        as_objects = [json.loads(line) for line in handle]
    return {
        "rss_mb": round(opened_mb, 1),
        "after_fetches_anon_mb": round(fetched_anon, 1),
        "after_fetches_file_mb": round(fetched_file, 1),
        "fetch_us": round(fetch_us, 2),
        "python_dicts_anon_mb": round(rss_mb("RssAnon") - anon, 1),
        "passages": len(as_objects),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--kinds", nargs="+", default=["flat", "hnsw", "ivfpq", "store"])
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument(
        "--reuse", action="store_true", help="Measure index files left in --work-dir by --keep."
    )
    parser.add_argument("--keep", action="store_true", help="Leave the index files in --work-dir.")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # internal: INDEX FILE
    parser.add_argument("--measure-store", type=Path, help=argparse.SUPPRESS)  # internal: STORE FOLDER
    args = parser.parse_args()
    if args.measure_store:
        print(json.dumps(measure_store(args.measure_store)))
        return
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    folder = args.work_dir or Path(tempfile.mkdtemp(prefix="retrieval_scale_"))
    folder.mkdir(parents=True, exist_ok=True)
    index_kinds = [k for k in args.kinds if k != "store"]
    rows = index_rows(index_kinds, args.count, args.dim, folder, args.reuse, args.keep) if index_kinds else []
    store = store_row(args.count, folder / "store") if "store" in args.kinds else None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\n{args.count} x {args.dim} random unit vectors; {os.cpu_count()} cores, load average "
        f"{tuple(round(x, 1) for x in os.getloadavg())}; builder peak RSS {peak:.0f} MB"
    )
    print(
        "| index | build s | index MB | loaded RSS MB | bytes/vector | search p50 ms | p99 ms "
        "| ms/query in batches of 32 | recall@10 vs flat | planted@10 | params |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['index']} | {r['build_s']} | {r['file_mb']} | {r['rss_mb']} | {r['bytes_per_vector']} | "
            f"{r['p50_ms']} | {r['p99_ms']} | {r['batch32_ms_per_query']} "
            f"| {r['recall@10_vs_flat']} | {r['planted@10']} | {r['params'] or ''} |"
        )
    if store:
        print(
            f"\ndocument store, {store['passages']} passages: files {store['file_mb']} MB (written in "
            f"{store['build_s']} s); resident after opening {store['rss_mb']} MB; after {STORE_FETCHES} "
            f"random fetches ({store['fetch_us']} us each) {store['after_fetches_anon_mb']} MB anonymous + "
            f"{store['after_fetches_file_mb']} MB file-backed (page cache); "
            f"the same passages as Python dicts: {store['python_dicts_anon_mb']} MB anonymous"
        )


def in_fresh_process(*args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def index_rows(kinds: list[str], count: int, dim: int, folder: Path, reuse: bool, keep: bool) -> list[dict]:
    vectors = unit_vectors(count, dim, seed=0)
    np.save(folder / "queries.npy", unit_vectors(QUERIES, dim, seed=1))
    planted, planted_rows = planted_queries(vectors, QUERIES, cosine=0.8, seed=2)
    np.save(folder / "planted.npy", planted)
    np.save(folder / "planted_rows.npy", planted_rows)
    rows = []
    for kind in ["flat"] + [k for k in kinds if k != "flat"]:  # flat first: it is the exact answer
        built = folder / f"{kind}.build.json"
        if reuse and built.exists() and (folder / f"{kind}.faiss").exists():
            row = json.loads(built.read_text())
        else:
            row = build(kind, vectors, folder)
            built.write_text(json.dumps(row))
        row |= in_fresh_process("--measure", str(folder / f"{kind}.faiss"))
        row["bytes_per_vector"] = round(row["file_mb"] * 2**20 / count, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if not keep:
            (folder / f"{kind}.faiss").unlink()
    return rows


def store_row(count: int, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    row = write_store(count, folder) | in_fresh_process("--measure-store", str(folder))
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
