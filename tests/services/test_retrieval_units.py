"""retrieval-server parts without a model: IVF-PQ sizing, the document store, manifests, the micro-batcher."""

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from services.retrieval_server.batcher import FairBatcher, Slice, plan_batch
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


def upper_all(slices: list[Slice]) -> list[list[str]]:
    return [[q.upper() for q in piece.queries] for piece in slices]


def test_plan_batch_round_robin_within_count_and_cost():
    # three requests: 4 cheap queries, 1 cheap, 3 costly (cost 10)
    pending = [([1, 1, 1, 1], 0), ([1], 0), ([10, 10, 10], 0)]
    # round 1 takes one of each (cost 1 + 1 + 10 = 12); then only the first request's cheap queries fit
    # (13, 14, 15); the third's next query would make 22
    assert plan_batch(pending, max_queries=100, max_cost=15) == [4, 1, 1]
    assert plan_batch(pending, max_queries=4, max_cost=100) == [2, 1, 1]  # the count limit ends round 2
    assert plan_batch([([50], 0), ([1], 0)], max_queries=8, max_cost=10) == [1, 0]  # the first always fits
    assert plan_batch([([1, 1, 1], 2), ([1], 1)], max_queries=8, max_cost=10) == [1, 0]  # already scheduled


def test_fair_batcher_groups_concurrent_requests_and_routes_results():
    calls: list[list[tuple]] = []
    threads: set[str] = set()

    def process(slices: list[Slice]) -> list[list[str]]:
        calls.append([tuple(piece.queries) for piece in slices])
        threads.add(threading.current_thread().name)
        time.sleep(0.02)  # the worker is busy; newcomers queue up meanwhile
        return upper_all(slices)

    async def run():
        batcher = FairBatcher(process, max_queries=12, max_cost=1000, max_wait_s=0.01)
        words = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
        first = await asyncio.gather(*(batcher.submit([w, w + "!"], [1, 1], None) for w in words))
        batcher.close()
        return first

    first = asyncio.run(run())
    assert first == [[w.upper(), w.upper() + "!"] for w in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]
    # 8 requests of 2 queries, 12 queries a batch: 12 + 4, never one call per request
    assert [sum(len(q) for q in call) for call in calls[:2]] == [12, 4]
    assert threads and not any(name.startswith("MainThread") for name in threads)  # off the event loop


def test_fair_batcher_interleaves_a_large_request_with_small_ones():
    calls: list[list[tuple]] = []

    def process(slices: list[Slice]) -> list[list[str]]:
        calls.append([tuple(piece.queries) for piece in slices])
        time.sleep(0.01)
        return upper_all(slices)

    async def run():
        batcher = FairBatcher(process, max_queries=64, max_cost=40, max_wait_s=0.0)
        big = asyncio.ensure_future(batcher.submit([f"q{i}" for i in range(100)], [10] * 100, "big"))
        await asyncio.sleep(0.005)  # the big request is being served
        small = await batcher.submit(["small"], [1], "small")
        finished_before_big = not big.done()
        results = await big
        batcher.close()
        return small, finished_before_big, results

    small, finished_before_big, results = asyncio.run(run())
    assert small == ["SMALL"] and finished_before_big
    assert results == [f"Q{i}" for i in range(100)]  # every slice landed in its place
    # each batch holds at most 40 of estimated cost: 4 big queries, or the small one and 3 big ones
    assert all(len(call) <= 2 and sum(len(q) for q in call) <= 4 for call in calls)
    first_with_small = next(i for i, call in enumerate(calls) if ("small",) in call)
    assert first_with_small <= 2  # served by the next batch or the one after, not after all 25


def test_fair_batcher_a_failing_request_fails_alone_and_the_loop_survives():
    def process(slices: list[Slice]) -> list[list[str]]:
        if any("boom" in piece.queries for piece in slices):
            raise RuntimeError("index exploded")
        return upper_all(slices)

    async def run():
        batcher = FairBatcher(process, max_queries=8, max_cost=100, max_wait_s=0.01)
        outcomes = await asyncio.gather(
            batcher.submit(["a"], [1], None),
            batcher.submit(["boom"], [1], None),
            batcher.submit(["b", "c"], [1, 1], None),
            return_exceptions=True,
        )
        after = await batcher.submit(["fine"], [1], None)
        batcher.close()
        return outcomes, after

    (first, failed, third), after = asyncio.run(run())
    assert first == ["A"] and third == ["B", "C"]  # the requests that shared its batch are answered
    assert isinstance(failed, RuntimeError) and "index exploded" in str(failed)
    assert after == ["FINE"]


def test_fair_batcher_reports_saturation_and_drops_abandoned_work():
    release = threading.Event()
    seen: list[str] = []

    def process(slices: list[Slice]) -> list[list[str]]:
        seen.extend(q for piece in slices for q in piece.queries)
        release.wait(10)
        return upper_all(slices)

    async def run():
        batcher = FairBatcher(process, max_queries=2, max_cost=100, max_wait_s=0.0, saturated_after_s=0.05)
        running = asyncio.ensure_future(batcher.submit(["r1", "r2"], [1, 1], None))
        await asyncio.sleep(0.02)  # the first batch is on the worker, blocked
        abandoned = asyncio.ensure_future(batcher.submit(["x1", "x2", "x3"], [1, 1, 1], None))
        waiting = asyncio.ensure_future(batcher.submit(["w"], [1], None))
        await asyncio.sleep(0.1)  # longer than saturated_after_s: both newcomers still wait
        busy = batcher.saturation()
        abandoned.cancel()  # its client went away before any of its queries ran
        release.set()
        answers = await asyncio.gather(running, waiting)
        idle = batcher.saturation()
        batcher.close()
        return busy, answers, idle

    busy, answers, idle = asyncio.run(run())
    assert busy is not None and "for its first micro-batch (4 queries queued)" in busy
    assert answers == [["R1", "R2"], ["W"]] and idle is None
    assert not any(q.startswith("x") for q in seen)  # the abandoned request's queries never ran


def test_settings_an_index_kind_never_reads_are_named_once_at_load(tmp_path, caplog):
    """A BM25 index embeds nothing and each FAISS kind has its own knob: --ef-search on a flat or IVF
    index, or --embedder, --device, --query-precision on a BM25 one, were accepted and did nothing."""
    import logging

    from fastapi.testclient import TestClient

    from services.retrieval_server.app import RetrievalServerSettings, create_app, inert_settings
    from services.retrieval_server.build import BuildConfig, build

    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": str(i), "contents": f'"Title {i}"\nthe river number {i} flows east'} for i in range(3)]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    build(BuildConfig(corpus=corpus, out=tmp_path / "bm25", index_type="bm25", progress=False))
    settings = RetrievalServerSettings(
        index=tmp_path / "bm25", query_precision="float32", device="cuda", ef_search=32, nprobe=4
    )
    caplog.set_level(logging.WARNING, logger="services.retrieval_server")
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/health").json()["status"] == "ok"
        assert client.post("/retrieve", json={"queries": ["river 1"], "topk": 1}).status_code == 200
    said = [r.getMessage() for r in caplog.records if r.name == "services.retrieval_server"]
    assert said == ["--query-precision, --device, --ef-search, --nprobe: no effect on a bm25 index; ignored"]
    # each FAISS kind reads its own knob alone; defaults are never named
    knobs = RetrievalServerSettings(ef_search=32, nprobe=4)
    assert inert_settings(knobs, "flat") == ["ef_search", "nprobe"]
    assert inert_settings(knobs, "hnsw") == ["nprobe"]
    assert inert_settings(knobs, "ivfpq") == ["ef_search"]
    assert inert_settings(RetrievalServerSettings(), "bm25") == []


def test_client_leaves_topk_to_the_server_unless_asked():
    """RetrievalClient.retrieve sent topk 3 when its caller gave none, so the server's --default-topk
    never applied to it."""
    from services.retrieval_server.client import RetrievalClient

    sent = []

    async def post(path, payload, **kwargs):
        sent.append((path, payload))
        return {"result": [[]]}

    async def ask():
        async with RetrievalClient("http://127.0.0.1:9") as client:
            client.http.post = post
            await client.retrieve(["q"])
            await client.retrieve(["q"], topk=5)

    asyncio.run(ask())
    assert [payload["topk"] for _, payload in sent] == [None, 5]  # null: the server's default_topk
