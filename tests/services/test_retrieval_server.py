"""retrieval-server against real uvicorn processes serving real indexes that the build CLI made.

The corpus is made up here: 240 passages about invented rivers, composers, volcanoes, beetles,
ships and festivals, each with a question only its own passage answers. The flat index is
embedded by the CLI; HNSW and IVF-PQ reuse its vectors (--vectors-from); BM25 embeds nothing.
The flat index is served by a real `python -m services.retrieval_server` process (HTTP, limits,
concurrency); the other kinds by the same app in this process (one model import for all three).
Queries are embedded in float32 so the answers do not depend on the CPU's bfloat16 support.
"""

import asyncio
import contextlib
import json
import logging
import os
import re
import subprocess
import threading
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import yaml
from fastapi.testclient import TestClient

from services.common.client import SyncServiceClient
from services.retrieval_server.app import RetrievalServerSettings, create_app
from services.retrieval_server.client import RetrievalClient, format_passages
from tests.helpers import ROOT, service_process

SYLLABLES = [
    "ka",
    "lor",
    "vin",
    "dru",
    "mes",
    "tal",
    "quor",
    "bel",
    "zan",
    "fio",
    "gra",
    "nim",
    "osk",
    "pel",
    "rux",
    "sil",
    "tam",
    "ul",
    "wen",
    "yot",
]
PLACES = [
    "Norvik",
    "Esterhal",
    "Quillon",
    "Maradu",
    "Tesskel",
    "Orbanne",
    "Vellmar",
    "Sundergrove",
    "Kapsis",
    "Limbreth",
]
SEAS = ["Amber", "Coral", "Silver", "Crimson", "Jade", "Azure", "Obsidian", "Ivory", "Saffron", "Cobalt"]
# (title, body, a question only this passage answers)
TEMPLATES = [
    (
        '"{n} River"',
        "The {n} River flows {a} kilometres through the {p} valley and ends in the {s} Sea.",
        "Which sea does the {n} River end in?",
    ),
    (
        '"{n} (composer)"',
        "{n} was a composer born in {p} in {y}; {n} wrote {a} symphonies for the harp.",
        "In which year was the composer {n} born?",
    ),
    (
        '"Mount {n}"',
        "Mount {n} is a volcano {a} metres high on the island of {p}, first climbed in {y}.",
        "How high is Mount {n}?",
    ),
    (
        '"{n} beetle"',
        "The {n} beetle is an insect of the {p} forests that feeds on {s} moss and lives {a} days.",
        "What does the {n} beetle feed on?",
    ),
    (
        '"HMS {n}"',
        "HMS {n} was a frigate launched in {y} at {p}; she carried {a} cannons and sank near the {s} reef.",
        "Where did HMS {n} sink?",
    ),
    (
        '"{n} festival"',
        "The {n} festival is held every spring in {p}, where {a} dancers parade with {s} lanterns.",
        "Where is the {n} festival held?",
    ),
]
N_PASSAGES = 240


def invented_name(i: int) -> str:
    return (SYLLABLES[i % 20] + SYLLABLES[(i // 20) % 20] + SYLLABLES[(i * 7 + 3) % 20]).capitalize()


def make_corpus() -> tuple[list[dict], list[str]]:
    rows, questions = [], []
    for i in range(N_PASSAGES):
        title, body, question = TEMPLATES[i % len(TEMPLATES)]
        fill = {
            "n": invented_name(i),
            "a": 37 + 13 * i,
            "p": PLACES[(i * 3) % 10],
            "s": SEAS[(i * 7) % 10],
            "y": 1500 + (i * 11) % 400,
        }
        if i % 2:  # Search-R1's other row shape: title + text; the store joins them as '"Title"\ntext'
            rows.append(
                {"id": f"p{i}", "title": title.format(**fill).strip('"'), "text": body.format(**fill)}
            )
        else:
            rows.append({"id": f"p{i}", "contents": title.format(**fill) + "\n" + body.format(**fill)})
        questions.append(question.format(**fill))
    return rows, questions


ROWS, QUESTIONS = make_corpus()
CONTENTS = {r["id"]: r.get("contents") or f'"{r["title"]}"\n{r["text"]}' for r in ROWS}


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.retrieval_server", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_all(commands: list[list[str]]) -> None:
    """Run CLI commands side by side; fail with the output of any that failed."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "services.retrieval_server", *c],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for c in commands
    ]
    for command, proc in zip(commands, procs):
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, f"{command} failed:\n{output[-3000:]}"


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("retrieval")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = {kind: folder / kind for kind in ("flat", "hnsw", "ivfpq", "bm25")}
    run_all(
        [
            ["build", "--corpus", str(corpus), "--out", str(out["flat"]), "--no-progress"],
            ["build", "--corpus", str(corpus), "--out", str(out["bm25"]), "--index", "bm25", "--no-progress"],
        ]
    )
    run_all(
        [
            [
                "build",
                "--corpus",
                str(corpus),
                "--out",
                str(out[kind]),
                "--index",
                kind,
                "--no-progress",
                "--vectors-from",
                str(out["flat"]),
            ]
            for kind in ("hnsw", "ivfpq")
        ]
    )
    return {"corpus": corpus, **out}


@pytest.fixture(scope="module")
def urls(indexes):
    # a long batching window so the concurrency test can see requests share a batch
    args = [
        "serve",
        "--index",
        str(indexes["flat"]),
        "--max-wait-ms",
        "25",
        "--max-queries",
        "256",
        "--query-precision",
        "float32",
        "--log-level",
        "warning",
    ]
    with service_process("services.retrieval_server", *args) as (url, _):
        yield {"flat": url}


@pytest.fixture(scope="module")
def apps(indexes):
    """hnsw, ivfpq and bm25: the real app, in this process, through TestClient."""
    with contextlib.ExitStack() as stack:
        clients = {}
        for kind in ("hnsw", "ivfpq", "bm25"):
            settings = RetrievalServerSettings(index=indexes[kind], query_precision="float32")
            clients[kind] = stack.enter_context(TestClient(create_app(settings)))
            wait_ready(clients[kind])
        yield clients


def wait_ready(client: TestClient, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = client.get("/health").json()
        if health["status"] != "loading":
            return health
        time.sleep(0.05)
    raise TimeoutError("app did not finish loading")


def retrieve(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/retrieve", json=body, timeout=60)


def top_ids(where: str | TestClient, queries: list[str], topk: int) -> list[list[str]]:
    body = {"queries": queries, "topk": topk, "return_scores": True}
    response = (
        where.post("/retrieve", json=body) if isinstance(where, TestClient) else retrieve(where, **body)
    )
    assert response.status_code == 200, response.text
    return [[hit["document"]["id"] for hit in hits] for hits in response.json()["result"]]


def test_build_writes_manifest_and_store(indexes):
    manifest = json.loads((indexes["flat"] / "manifest.json").read_text())
    assert manifest["count"] == N_PASSAGES and manifest["metric"] == "inner_product"
    assert manifest["embedder"]["name"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert manifest["embedder"]["dimension"] == 384
    import hashlib

    assert manifest["corpus_sha256"] == hashlib.sha256(indexes["corpus"].read_bytes()).hexdigest()
    ivfpq = json.loads((indexes["ivfpq"] / "manifest.json").read_text())["params"]
    # 240 passages: nlist = min(4*sqrt(240)=62, 240//39=6); 240/4 = 60 points afford 5-bit codes;
    # ~384 bits of code: 64 sub-quantisers (384 // 5 = 76, largest divisor below); all 6 lists searched.
    assert ivfpq == {"nlist": 6, "pq_m": 64, "pq_nbits": 5, "nprobe": 6, "train_size": 240}
    assert json.loads((indexes["bm25"] / "manifest.json").read_text())["embedder"] is None
    lines = (indexes["flat"] / "docs.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {"id": "p1", "contents": CONTENTS["p1"]}
    assert not list(indexes["flat"].parent.glob("*.partial"))


def test_response_shape_with_scores(urls):
    passage = CONTENTS["p10"]
    response = retrieve(urls["flat"], queries=[passage, QUESTIONS[3]], topk=4, return_scores=True)
    assert response.status_code == 200
    result = response.json()["result"]
    assert list(response.json()) == ["result"] and len(result) == 2 and all(len(hits) == 4 for hits in result)
    for hits in result:
        for hit in hits:
            assert set(hit) == {"document", "score"} and set(hit["document"]) == {"id", "contents"}
            assert isinstance(hit["score"], float) and -1.0001 <= hit["score"] <= 1.0001
        scores = [hit["score"] for hit in hits]
        assert scores == sorted(scores, reverse=True)
    # The passage's own text, with MiniLM's empty prefixes, embeds to the stored vector: cosine 1.
    assert result[0][0]["document"] == {"id": "p10", "contents": passage}
    assert result[0][0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert result[0][1]["score"] < 0.95


def test_response_shape_without_scores_and_defaults(urls):
    body = retrieve(urls["flat"], queries=[QUESTIONS[7]]).json()  # Search-R1 defaults: topk 3, no scores
    assert len(body["result"][0]) == 3
    assert all(set(doc) == {"id", "contents"} for doc in body["result"][0])
    assert body["result"][0][0] == {"id": "p7", "contents": CONTENTS["p7"]}
    explicit = retrieve(urls["flat"], queries=[QUESTIONS[7]], topk=None, return_scores=False).json()
    assert explicit == body
    assert len(retrieve(urls["flat"], queries=["x"], topk=1).json()["result"][0]) == 1


def test_flat_finds_the_passage_that_answers(urls):
    ranked = top_ids(urls["flat"], QUESTIONS, topk=3)
    at1 = sum(ids[0] == f"p{i}" for i, ids in enumerate(ranked)) / N_PASSAGES
    at3 = sum(f"p{i}" in ids for i, ids in enumerate(ranked)) / N_PASSAGES
    assert at1 >= 0.8 and at3 >= 0.95, (at1, at3)


@pytest.mark.parametrize("kind, needed_at_1", [("hnsw", 1.0), ("ivfpq", 0.85), ("bm25", 1.0)])
def test_each_index_kind_serves(urls, apps, kind, needed_at_1):
    passages = [CONTENTS[f"p{i}"] for i in range(N_PASSAGES)]
    ranked = top_ids(apps[kind], passages, topk=3)
    self_at_1 = sum(ids[0] == f"p{i}" for i, ids in enumerate(ranked)) / N_PASSAGES
    assert self_at_1 >= needed_at_1, (kind, self_at_1)
    if kind != "bm25":  # the approximate indexes mostly agree with exact search on the questions
        exact, approx = top_ids(urls["flat"], QUESTIONS, 3), top_ids(apps[kind], QUESTIONS, 3)
        overlap = sum(len(set(a) & set(b)) for a, b in zip(exact, approx)) / (3 * N_PASSAGES)
        assert overlap >= (0.95 if kind == "hnsw" else 0.6), (kind, overlap)


def test_health_names_the_index(urls, apps):
    health = httpx.get(urls["flat"] + "/health").json()
    assert health["status"] == "ok" and health["index"] == "flat" and health["passages"] == N_PASSAGES
    assert health["embedder"] == "sentence-transformers/all-MiniLM-L6-v2" and health["dimension"] == 384
    assert apps["hnsw"].get("/health").json()["index"] == "hnsw"
    assert apps["bm25"].get("/health").json()["embedder"] is None


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"queries": []}, 422, "queries: List should have at least 1 item"),
        ({"queries": ["fine", ""]}, 422, "queries.1: Value error, query is an empty string"),
        ({"queries": ["   "]}, 422, "query is an empty string"),
        ({"queries": ["q"], "topk": 0}, 422, "topk: must be between 1 and 100, got 0"),
        ({"queries": ["q"], "topk": 101}, 422, "topk: must be between 1 and 100, got 101"),
        ({"queries": ["q"], "topk": -3}, 422, "topk"),
        ({"queries": [1, "q"]}, 422, "queries.0: Input should be a valid string"),
        ({"queries": [None]}, 422, "queries.0: Input should be a valid string"),
        ({"queries": "one string"}, 422, "queries: Input should be a valid list"),
        ({"queries": [["nested"]]}, 422, "queries.0"),
        ({"query": ["typo"]}, 422, "queries: Field required"),
        ({"queries": ["q"] * 257}, 413, "257 queries in one request; the limit is 256"),
    ],
)
def test_bad_input_is_a_clear_4xx(urls, body, status, needle):
    response = retrieve(urls["flat"], **body)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]


def test_oversized_and_malformed_bodies(urls):
    huge = httpx.post(
        urls["flat"] + "/retrieve",
        content=b'{"queries": ["' + b"a" * (5 * 1024 * 1024) + b'"]}',
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert huge.status_code == 413 and "larger than the limit" in huge.json()["error"]
    broken = httpx.post(
        urls["flat"] + "/retrieve", content=b'{"queries": [', headers={"content-type": "application/json"}
    )
    assert broken.status_code == 422 and "invalid JSON" in broken.json()["error"]
    # the server kept serving; a runaway query (100k characters) is cut, not refused
    assert retrieve(urls["flat"], queries=[QUESTIONS[0]], topk=1).status_code == 200
    runaway = retrieve(urls["flat"], queries=[CONTENTS["p9"] + " filler" * 15000], topk=1, return_scores=True)
    assert runaway.status_code == 200 and runaway.json()["result"][0][0]["document"]["id"] == "p9"


def batch_totals(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    count = float(re.search(r"^retrieval_server_batch_requests_count (\S+)$", text, re.MULTILINE).group(1))
    total = float(re.search(r"^retrieval_server_batch_requests_sum (\S+)$", text, re.MULTILINE).group(1))
    return count, total


def test_concurrent_requests_share_batches_and_match_one_by_one(urls):
    url = urls["flat"]
    queries = QUESTIONS[:48]
    alone = [retrieve(url, queries=[q], topk=3, return_scores=True).json()["result"][0] for q in queries]
    batches_before, requests_before = batch_totals(url)

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            responses = await asyncio.gather(
                *(
                    client.post(url + "/retrieve", json={"queries": [q], "topk": 3, "return_scores": True})
                    for q in queries
                )
            )
        return [r.json()["result"][0] for r in responses]

    together = asyncio.run(burst())
    batches_after, requests_after = batch_totals(url)
    assert requests_after - requests_before == 48
    assert batches_after - batches_before <= 24, "48 concurrent requests should share embed calls"
    for a, b in zip(alone, together):
        assert [h["document"]["id"] for h in a] == [h["document"]["id"] for h in b]
        assert [h["score"] for h in a] == pytest.approx([h["score"] for h in b], abs=1e-4)


def test_mixed_topk_in_one_batch(urls):
    url = urls["flat"]

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        url + "/retrieve",
                        json={"queries": [QUESTIONS[i], QUESTIONS[i + 1]], "topk": 1 + i % 4},
                    )
                    for i in range(12)
                )
            )

    for i, response in enumerate(asyncio.run(burst())):
        result = response.json()["result"]
        assert [len(docs) for docs in result] == [1 + i % 4] * 2


def test_async_client(urls):
    async def run():
        async with RetrievalClient(urls["flat"], retries=1) as client:
            await client.wait_healthy(5)
            scored = await client.retrieve([QUESTIONS[4], QUESTIONS[5]], topk=2)
            plain = await client.retrieve([QUESTIONS[4]], topk=2, return_scores=False)
            return scored, plain

    scored, plain = asyncio.run(run())
    assert [len(h) for h in scored] == [2, 2] and scored[0][0].document.id == "p4"
    assert scored[0][0].score > scored[0][1].score
    assert plain[0][0].document == scored[0][0].document and plain[0][0].score is None
    title = invented_name(4)
    assert scored[0][0].document.title == f"HMS {title}"  # passage 4 is a ship's
    text = format_passages(scored[0])
    assert (
        text.startswith(f'Doc 1(Title: "HMS {title}") HMS {title} was a frigate')
        and "\nDoc 2(Title: " in text
    )


def connections_to(port: int) -> set[int]:
    """Local ports of this process's established TCP connections to `port` (the server's)."""
    return {
        c.laddr.port
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


@contextlib.contextmanager
def counting_socket_polls(counts: dict):
    """Counts, in counts["polls"], httpcore's checks of whether an idle kept-alive socket was closed
    by the server (a poll() each), as they happen in this thread."""

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name == "is_socket_readable" and "httpcore" in code.co_filename:
            counts["polls"] += 1

    counts["polls"] = 0
    sys.setprofile(profile)
    threading.setprofile(profile)  # and in the threads started inside
    try:
        yield counts
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def test_64_concurrent_client_calls_each_keep_a_connection_and_poll_only_their_own(urls):
    """Issue 28: 64 callers sharing one RetrievalClient got half the throughput of 32, p99 in seconds.
    The client's one httpx pool held all 64 connections and, on every request and every response,
    polled the socket of each idle one: 330 polls a request, 10-12 ms of CPU (bench/retrieval_server.py
    --client service), taken from the server's two cores. Now each call in flight holds a connection
    of its own and hands it to a later call; nothing walks the other connections."""
    url, port = urls["flat"], httpx.URL(urls["flat"]).port
    queries = QUESTIONS[:64]
    expected = top_ids(url, queries, topk=1)  # one request of 64 queries
    counts: dict = {}

    async def run() -> tuple[list, set[int], list, set[int]]:
        async with RetrievalClient(url, retries=0, max_connections=64) as client:
            first = await asyncio.gather(*(client.retrieve([q], topk=1) for q in queries))
            opened = connections_to(port)
            with counting_socket_polls(counts):
                second = await asyncio.gather(*(client.retrieve([q], topk=1) for q in reversed(queries)))
            return first, opened, second[::-1], connections_to(port)

    first, opened, second, reused = asyncio.run(run())
    for answers in (first, second):
        assert [[hit.document.id for hit in hits[0]] for hits in answers] == expected
    assert len(opened) == 64, "each of the 64 calls in flight has a connection, kept alive after"
    assert reused == opened, "the next 64 calls reuse those connections, opening none"
    # each call checks its own idle connection once or twice; one pool of 64 polled 330 times a call.
    # 0 < : httpcore still checks this way (were it renamed, this would count nothing)
    assert 0 < counts["polls"] <= 2 * 64, counts


def test_64_threads_sharing_one_sync_client_each_keep_a_connection_and_poll_only_their_own(urls):
    """The same for the SyncServiceClient (the reward hook verl calls, maybe from a thread pool): it held
    one httpx.Client, which kept 20 connections alive (httpx's default), so a round of 64 threads left at
    most 20 for the next round and the rest reconnected."""
    url, port = urls["flat"], httpx.URL(urls["flat"]).port
    queries = QUESTIONS[:64]
    expected = top_ids(url, queries, topk=1)
    client = SyncServiceClient(url, retries=0, max_connections=64)

    def round_of_calls(order: list[str]) -> list[list[str]]:
        together = threading.Barrier(len(order))  # all 64 calls in flight at once

        def call(query: str) -> list[str]:
            together.wait(timeout=60)
            body = client.post("/retrieve", {"queries": [query], "topk": 1, "return_scores": True})
            return [hit["document"]["id"] for hit in body["result"][0]]

        with ThreadPoolExecutor(len(order)) as pool:
            return list(pool.map(call, order))

    counts: dict = {}
    try:
        assert round_of_calls(queries) == expected
        opened = connections_to(port)
        with counting_socket_polls(counts):
            assert round_of_calls(queries[::-1]) == expected[::-1]
        reused = connections_to(port)
    finally:
        client.close()
    assert 20 < len(opened) <= 64, "calls in flight together each held a connection, kept alive after"
    assert reused == opened, "the next round reuses those connections, opening none"
    assert 0 < counts["polls"] <= 2 * 64, counts


def test_verl_tool_config_points_here(urls):
    config = yaml.safe_load((ROOT / "jobgroup/tools/search_tool_config.yaml").read_text())
    tool = config["tools"][0]
    assert tool["class_name"] == "verl.tools.search_tool.SearchTool" and tool["config"]["type"] == "native"
    assert tool["tool_schema"]["function"]["parameters"]["required"] == ["query_list"]
    omegaconf = pytest.importorskip("omegaconf")
    os.environ["RETRIEVAL_SERVER_URL"] = urls["flat"]
    try:
        loaded = omegaconf.OmegaConf.load(ROOT / "jobgroup/tools/search_tool_config.yaml")
        resolved = omegaconf.OmegaConf.to_container(loaded.tools[0].config, resolve=True)
    finally:
        del os.environ["RETRIEVAL_SERVER_URL"]
    assert resolved["retrieval_service_url"] == urls["flat"] + "/retrieve"
    # what verl's search_r1_like_utils sends, and the fields it reads back
    body = httpx.post(
        resolved["retrieval_service_url"],
        json={"queries": [QUESTIONS[2]], "topk": resolved["topk"], "return_scores": True},
    ).json()
    assert body["result"][0][0]["document"]["contents"].split("\n")[0] == CONTENTS["p2"].split("\n")[0]


def test_manifest_for_another_embedder_is_refused_in_one_line(indexes):
    # settings come from env too: the index folder here, the embedder as a flag (no subcommand: serve)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.retrieval_server",
            "--embedder",
            "intfloat/e5-base-v2",
            "--port",
            "0",
        ],
        cwd=ROOT,
        env={**os.environ, "RETRIEVAL_SERVER_INDEX": str(indexes["flat"])},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        (
            "error: the index was built with embedder 'sentence-transformers/all-MiniLM-L6-v2' (384-d) "
            "but the server was given 'intfloat/e5-base-v2'; "
            "serve it with the same embedder or rebuild the index"
        )
    ]


def test_manifest_dimension_mismatch_fails_the_load(indexes, tmp_path):
    import shutil

    tampered = tmp_path / "tampered"
    shutil.copytree(indexes["flat"], tampered)
    manifest = json.loads((tampered / "manifest.json").read_text())
    manifest["embedder"]["dimension"] = 768
    (tampered / "manifest.json").write_text(json.dumps(manifest))
    result = cli("serve", "--index", str(tampered), "--port", "0", "--log-format", "text", timeout=120)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert "holds 768-d vectors" in errors[0] and "makes 384-d vectors" in errors[0]


def test_serve_and_build_errors_are_one_line(indexes, tmp_path):
    missing = cli("serve", "--index", str(tmp_path / "nope"), "--port", "0", timeout=60)
    assert missing.returncode != 0 and missing.stderr.strip().splitlines() == [
        f"error: index folder {tmp_path / 'nope'} does not exist "
        + "(build one with `python -m services.retrieval_server build`)"
    ]
    exists = cli(
        "build", "--corpus", str(indexes["corpus"]), "--out", str(indexes["flat"]), "--index", "bm25"
    )
    assert (
        exists.returncode != 0
        and exists.stderr.strip().splitlines()[-1]
        == f"error: {indexes['flat']} exists; pass --overwrite to replace it"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "contents": "fine"}\n{"id": "b", "body": "no text"}\n')
    result = cli("build", "--corpus", str(bad), "--out", str(tmp_path / "out"), "--index", "bm25")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {bad} line 2: needs a string 'contents', or 'title' and 'text' (has ['body', 'id'])"
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_lone_surrogate_fails_alone_and_the_batch_is_served(urls):
    """Issue 10: the tokenizer raised on "\\ud800" and every request sharing its micro-batch got a 500."""
    url = urls["flat"]
    bad_body = b'{"queries": ["\\ud800"], "topk": 3}'  # valid JSON escapes, not valid Unicode text

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            good = [client.post(url + "/retrieve", json={"queries": [q], "topk": 1}) for q in QUESTIONS[:30]]
            bad = client.post(
                url + "/retrieve", content=bad_body, headers={"content-type": "application/json"}
            )
            return await asyncio.gather(bad, *good)

    bad, *good = asyncio.run(burst())
    assert bad.status_code == 422 and "invalid JSON" in bad.json()["error"]
    assert [r.status_code for r in good] == [200] * 30
    assert sum(r.json()["result"][0][0]["id"] == f"p{i}" for i, r in enumerate(good)) >= 24


def test_a_large_request_does_not_hold_back_a_small_one(urls):
    """Issue 10: 1,000 queries of 4,000 characters held another client's one query for 58 s. Now the
    large request is served a slice per micro-batch, and the small one rides in the next batch."""
    url = urls["flat"]
    big = {"queries": [f"{QUESTIONS[i]} " + "filler " * 570 for i in range(64)], "topk": 3}  # 4,000 chars
    count_before = batch_totals(url)[0]
    outcome: dict = {}

    def send_big():
        outcome["big"] = httpx.post(url + "/retrieve", json=big, timeout=600)
        outcome["big_done"] = time.monotonic()

    thread = threading.Thread(target=send_big)
    thread.start()
    deadline = time.monotonic() + 120
    while batch_totals(url)[0] == count_before:  # wait until the big request is being served
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    small = retrieve(url, queries=[QUESTIONS[5]], topk=1)
    small_done = time.monotonic()
    assert thread.is_alive(), "the large request finished before the small one was even sent"
    thread.join()
    assert small.status_code == 200 and small.json()["result"][0][0]["id"] == "p5"
    assert small_done < outcome["big_done"]
    assert outcome["big"].status_code == 200 and len(outcome["big"].json()["result"]) == 64
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_empty_bm25_queries_do_not_flood_the_log(apps, caplog):
    # bm25s logs a line per query with no indexed token; 1,000 of them in a request once wrote 150 KB
    # of log, enough to block a server whose output pipe is read slowly.
    caplog.set_level(logging.INFO)
    body = {"queries": ["0"] * 1000, "topk": 1}
    assert apps["bm25"].post("/retrieve", json=body).status_code == 200
    assert not [r for r in caplog.records if r.name.startswith("bm25s")]
