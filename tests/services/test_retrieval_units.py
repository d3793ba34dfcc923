"""retrieval-server parts without a model: IVF-PQ sizing, the document store, manifests, the micro-batcher."""

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from services.retrieval_server.batcher import MicroBatcher
from services.retrieval_server.core import hits_json
from services.retrieval_server.embedder import default_prefixes, default_threads, resolve_model_path
from services.retrieval_server.index import HnswParams, build_faiss_index, ivfpq_params
from services.retrieval_server.store import (
    CorpusError,
    CorpusReader,
    DocStore,
    DocStoreWriter,
    EmbedderInfo,
    Manifest,
    ManifestError,
    check_embedder_dimension,
    check_embedder_name,
    passage_from_row,
    read_manifest,
)


def test_ivfpq_sizes_follow_the_corpus():
    # SQuAD dev, 2067 passages: 4*sqrt(2067) = 182 lists, but 2067 // 39 = 53 keeps 39 points per centroid;
    # 2067 / 4 = 516 points afford 2**8 PQ entries; 384 bits of code / 8 = 48 sub-quantisers;
    # nprobe max(8, 53 // 16 = 3) = 8.
    assert ivfpq_params(2067, 384) == ivfpq_params(2067, 384, None, None, None, None)
    p = ivfpq_params(2067, 384)
    assert (p.nlist, p.pq_nbits, p.pq_m, p.nprobe, p.train_size) == (53, 8, 48, 8, 2067)
    # 240 passages: 240 / 4 = 60 affords 2**5; 384 // 5 = 76 -> the largest divisor of 384 up to it is 64.
    p = ivfpq_params(240, 384)
    assert (p.nlist, p.pq_nbits, p.pq_m, p.nprobe) == (6, 5, 64, 6)
    # 1M: 4000 lists, full 8-bit codes, nprobe 4000 // 16 = 250, train on max(64*4000, 39*4000) = 256000.
    p = ivfpq_params(1_000_000, 384)
    assert (p.nlist, p.pq_nbits, p.pq_m, p.nprobe, p.train_size) == (4000, 8, 48, 250, 256_000)
    # e5-base (768-d) on wiki-18 (21M): 96 sub-quantisers of 8 dims, 4*sqrt(21e6) = 18330 lists.
    p = ivfpq_params(21_000_000, 768)
    assert (p.nlist, p.pq_m, p.pq_nbits) == (18330, 96, 8)
    # 100-d at 8 bits: 100 // 8 = 12 -> the largest divisor of 100 up to it is 10.
    assert (ivfpq_params(5000, 100).pq_nbits, ivfpq_params(5000, 100).pq_m) == (8, 10)
    assert ivfpq_params(40, 64).pq_nbits == 4  # 40 / 4 = 10 affords 3 bits; 4 is the floor
    assert ivfpq_params(5000, 100, nlist=16, nprobe=64).nprobe == 16  # never more lists than exist
    with pytest.raises(ValueError, match="must divide"):
        ivfpq_params(5000, 384, pq_m=10)


@pytest.mark.parametrize("count", [40, 300, 3000])
def test_ivfpq_trains_on_small_corpora(count):
    vectors = np.random.default_rng(0).standard_normal((count, 64)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    params = ivfpq_params(count, 64)
    index = build_faiss_index("ivfpq", vectors, HnswParams(), params)
    assert index.is_trained and index.ntotal == count
    _, rows = index.search(vectors[:5], 1)
    assert (rows[:, 0] >= 0).all()


def test_rows_in_both_search_r1_shapes():
    assert passage_from_row({"id": 7, "contents": '"T"\nbody'}, 1).contents == '"T"\nbody'
    assert passage_from_row({"id": 7, "contents": "x"}, 1).id == "7"  # ids travel as strings
    assert passage_from_row({"title": "Paris", "text": "Capital."}, 4).contents == '"Paris"\nCapital.'
    assert passage_from_row({"title": "Paris", "text": "Capital."}, 4).id == "3"  # wiki-18: the row number
    for row, needle in [
        ({"id": "a"}, "needs a string 'contents'"),
        ({"contents": "  "}, "empty"),
        ([1, 2], "expected a JSON object"),
        ({"contents": 5}, "needs a string"),
    ]:
        with pytest.raises(CorpusError, match=needle):
            passage_from_row(row, 9)


def test_store_round_trip_and_corpus_hash(tmp_path):
    corpus = tmp_path / "c.jsonl"
    rows = [
        {"id": "0", "contents": '"Zürich"\nA city — with "quotes", \\ and a\nsecond line.'},
        {"id": "1", "title": "日本", "text": "Japan."},
    ]
    corpus.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    reader = CorpusReader(corpus)
    writer = DocStoreWriter(tmp_path)
    for passage in reader:
        writer.add(passage)
    writer.close()
    import hashlib

    assert reader.sha256 == hashlib.sha256(corpus.read_bytes()).hexdigest()
    store = DocStore(tmp_path)
    assert len(store) == 2
    assert store.get(0) == rows[0]
    assert store.get(1) == {"id": "1", "contents": '"日本"\nJapan.'}
    # hits_json splices the stored bytes: the result parses to exactly the documents and scores.
    body = hits_json(store, np.array([0.5, 0.25], dtype=np.float32), np.array([1, -1]), return_scores=True)
    assert json.loads(body) == [{"document": store.get(1), "score": 0.5}]  # -1 (no hit) is dropped
    assert json.loads(hits_json(store, np.zeros(2), np.array([0, 1]), return_scores=False)) == [
        rows[0],
        store.get(1),
    ]


def test_unreadable_corpus_lines(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "0", "contents": "ok"}\n{not json\n')
    with pytest.raises(CorpusError, match="line 2: not JSON"):
        list(CorpusReader(corpus))
    with pytest.raises(CorpusError, match="does not exist"):
        CorpusReader(tmp_path / "missing.jsonl")


def test_manifest_checks(tmp_path):
    manifest = Manifest(
        index_type="flat",
        metric="inner_product",
        count=3,
        corpus_path="c",
        corpus_sha256="0" * 64,
        embedder=EmbedderInfo(name="intfloat/e5-base-v2", dimension=768),
    )
    manifest.write(tmp_path)
    assert read_manifest(tmp_path) == manifest
    check_embedder_name(manifest, "/models/e5-base-v2/")  # the same model from a local copy is fine
    check_embedder_name(manifest, None)
    with pytest.raises(ManifestError, match="built with embedder 'intfloat/e5-base-v2' \\(768-d\\)"):
        check_embedder_name(manifest, "sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(ManifestError, match="holds 768-d vectors"):
        check_embedder_dimension(manifest, "intfloat/e5-base-v2", 384)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ManifestError, match="unreadable"):
        read_manifest(tmp_path)
    with pytest.raises(ManifestError, match="no manifest.json"):
        read_manifest(tmp_path / "..")


def test_embedder_defaults():
    assert default_prefixes("intfloat/e5-base-v2").query == "query: "
    assert default_prefixes("/m/e5-large-v2").passage == "passage: "
    assert default_prefixes("BAAI/bge-base-en-v1.5").query.startswith("Represent this sentence")
    assert default_prefixes("sentence-transformers/all-MiniLM-L6-v2").query == ""
    assert resolve_model_path("intfloat/e5-base-v2") == "intfloat/e5-base-v2"
    assert resolve_model_path("sentence-transformers/all-MiniLM-L6-v2").endswith("model")  # the packaged copy
    assert default_threads(2) == 1 and default_threads(1) == 1 and default_threads(16) == 15


def test_micro_batcher_groups_concurrent_jobs_and_routes_results():
    calls: list[list[str]] = []
    threads: set[str] = set()

    def process(jobs: list[str]) -> list[str]:
        calls.append(list(jobs))
        threads.add(threading.current_thread().name)
        time.sleep(0.02)  # the worker is busy; newcomers queue up meanwhile
        return [job.upper() for job in jobs]

    async def run():
        batcher = MicroBatcher(process, size_of=len, max_batch=12, max_wait_s=0.01)
        first = await asyncio.gather(
            *(batcher.submit(w) for w in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"])
        )
        big = await asyncio.gather(batcher.submit("x" * 30), batcher.submit("y"))
        batcher.close()
        return first, big

    first, big = asyncio.run(run())
    assert first == ["AB", "CD", "EF", "GH", "IJ", "KL", "MN", "OP"]  # each caller gets its own answer
    # 8 jobs of size 2 with max_batch 12: two calls of 6 + 2 jobs, never one per job
    assert [len(c) for c in calls[:2]] == [6, 2]
    assert big == ["X" * 30, "Y"] and ["x" * 30] in calls  # an oversized job still runs, alone
    assert threads and not any(name.startswith("MainThread") for name in threads)  # off the event loop


def test_micro_batcher_failure_reaches_every_caller_and_the_loop_survives():
    def process(jobs):
        if "boom" in jobs:
            raise RuntimeError("index exploded")
        return jobs

    async def run():
        batcher = MicroBatcher(process, size_of=lambda job: 1, max_batch=8, max_wait_s=0.01)
        failed = await asyncio.gather(batcher.submit("a"), batcher.submit("boom"), return_exceptions=True)
        after = await batcher.submit("fine")
        batcher.close()
        return failed, after

    failed, after = asyncio.run(run())
    assert all(isinstance(f, RuntimeError) and "index exploded" in str(f) for f in failed)
    assert after == "fine"
