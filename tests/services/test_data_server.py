"""data-server against real uvicorn processes: determinism, epochs, resume, sources, bad input, export."""

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from services.data_server.app import DataServerSettings, create_app
from services.data_server.client import DataClient
from services.data_server.synthetic import make_problem
from tests.helpers import ROOT, SHARED_DATA, service_process

GSM8K_ROWS = [
    {
        "question": f"Sam has {i} apples and buys 1,000 more. How many now?",
        "answer": f"{i}+1000=<<{i}+1000={i + 1000}>>\n#### {i + 1000:,}",
    }
    for i in range(40)
]


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gsm8k")
    for split, rows in (("train", GSM8K_ROWS[:30]), ("test", GSM8K_ROWS[30:])):
        (folder / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


@pytest.fixture(scope="module")
def servers(gsm8k_dir):
    """Two independent server processes with the same settings."""
    args = [
        "--datasets",
        f"gsm8k={gsm8k_dir}",
        "synthetic-arith=synthetic-arith:medium",
        "--synthetic-train-size",
        "100",
        "--synthetic-test-size",
        "10",
        "--seed",
        "7",
    ]
    with (
        service_process("services.data_server", *args) as (url_a, _),
        service_process("services.data_server", *args) as (url_b, _),
    ):
        yield url_a, url_b


def post_batch(url, **body):
    return httpx.post(url + "/v1/batches", json=body, timeout=10)


def walk(url, dataset, batch_size, n_batches, cursor=None, split="train"):
    batches = []
    for _ in range(n_batches):
        response = post_batch(url, dataset=dataset, split=split, batch_size=batch_size, cursor=cursor)
        assert response.status_code == 200, response.text
        batches.append(response.json())
        cursor = batches[-1]["next_cursor"]
    return batches


def test_same_cursor_same_batch_across_processes(servers):
    url_a, url_b = servers
    a = walk(url_a, "synthetic-arith", 16, 9)
    b = walk(url_b, "synthetic-arith", 16, 9)
    assert a == b
    # ... and it is a shuffle, not the file order
    assert [item["uid"] for item in a[0]["items"]] != [f"synthetic-arith/train/{i}" for i in range(16)]


def test_every_item_exactly_once_per_epoch(servers):
    url, _ = servers
    size = 100
    batches = walk(url, "synthetic-arith", 8, 25)  # 200 items = two full epochs
    uids = [item["uid"] for b in batches for item in b["items"]]
    first, second = uids[:size], uids[size:]
    assert sorted(first) == sorted(f"synthetic-arith/train/{i}" for i in range(size))
    assert sorted(second) == sorted(first)
    assert first != second  # each epoch has its own order
    # the batch that straddles the boundary (items 96..103) starts in epoch 0 and hands a cursor into epoch 1
    assert batches[12]["epoch"] == 0 and batches[12]["offset"] == 96
    assert batches[12]["next_cursor"].startswith("1.4.")


def test_resume_from_saved_cursor(servers):
    url, _ = servers
    straight = walk(url, "gsm8k", 7, 6)
    saved = straight[2]["next_cursor"]
    resumed = walk(url, "gsm8k", 7, 3, cursor=saved)
    assert resumed == straight[3:]


def test_items_carry_verl_fields(servers):
    url, _ = servers
    item = post_batch(url, dataset="gsm8k", split="test", batch_size=1).json()["items"][0]
    assert item["data_source"] == "openai/gsm8k" and item["ability"] == "math"
    assert item["prompt"][0]["role"] == "user"
    assert item["prompt"][0]["content"].endswith(
        'Let\'s think step by step and output the final answer after "####".'
    )
    index = item["extra_info"]["index"]
    assert item["reward_model"] == {"style": "rule", "ground_truth": str(30 + index + 1000)}  # commas removed
    assert item["extra_info"]["split"] == "test"
    assert set(item["extra_info"]) == {"split", "index", "answer", "question"}
    assert item["uid"] == f"gsm8k/test/{index}"


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"dataset": "gsm8k", "batch_size": 0}, 422, "batch_size"),
        ({"dataset": "gsm8k", "batch_size": -5}, 422, "batch_size"),
        ({"dataset": "gsm8k", "batch_size": 5000}, 422, "batch_size: must be at most 4096"),
        ({"dataset": "gsm8k", "batch_size": 31}, 409, "batch_size: 31 is larger than split 'train'"),
        ({"dataset": "nope", "batch_size": 2}, 404, "available: ['gsm8k', 'synthetic-arith']"),
        ({"dataset": "gsm8k", "split": "dev", "batch_size": 2}, 404, "available: ['test', 'train']"),
        ({"dataset": "gsm8k", "batch_size": 2, "cursor": "garbage"}, 422, "cursor"),
        ({"dataset": "gsm8k", "batch_size": 2, "cursor": "0.99.abc"}, 422, "cursor"),
        ({"dataset": "gsm8k", "batch_size": 2, "cursor": "0.999999.00000000"}, 409, "cursor"),
        ({"dataset": "gsm8k", "batch_size": "many"}, 422, "batch_size"),
        ({"dataset": "gsm8k", "batch_size": True}, 422, "batch_size: Input should be a valid integer"),
        ({"dataset": "gsm8k", "batch_size": "3"}, 422, "batch_size: Input should be a valid integer"),
        # issue 10: an epoch that int() refuses, or 4,301 digits (past int()'s limit), was a 500
        (
            {"dataset": "gsm8k", "batch_size": 2, "cursor": "\u00b2.0.ce61368b"},
            422,
            "cursor: String should match pattern",
        ),
        (
            {"dataset": "gsm8k", "batch_size": 2, "cursor": "9" * 4301 + ".0.ce61368b"},
            422,
            "cursor: String should match pattern",
        ),
        ({"dataset": "gsm8k"}, 422, "batch_size: Field required"),
    ],
)
def test_bad_input_is_a_clear_4xx(servers, body, status, needle):
    url, _ = servers
    response = post_batch(url, **body)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]


def test_a_huge_unknown_name_is_not_echoed_back(servers):
    url, _ = servers
    response = post_batch(url, dataset="n" * (15 * 1024 * 1024), batch_size=2)
    assert response.status_code == 404
    assert len(response.content) < 500 and "(15728640 characters); available:" in response.json()["error"]


def test_cursor_from_another_split_is_refused(servers):
    url, _ = servers
    cursor = post_batch(url, dataset="gsm8k", split="train", batch_size=2).json()["next_cursor"]
    response = post_batch(url, dataset="gsm8k", split="test", batch_size=2, cursor=cursor)
    assert response.status_code == 409 and "another dataset" in response.json()["error"]


def test_datasets_seed_routes_and_metrics(servers):
    url, _ = servers
    listed = httpx.get(url + "/v1/datasets").json()["datasets"]
    assert {d["name"]: d["splits"] for d in listed} == {
        "gsm8k": {"train": 30, "test": 10},
        "synthetic-arith": {"train": 100, "test": 10},
    }
    seed = httpx.get(
        url + "/prompts", params={"batch_size": 3, "shuffle": "false", "dataset": "gsm8k"}
    ).json()
    assert seed["total_available"] == 30 and len(seed["prompts"]) == 3
    assert (
        seed["prompts"][0]["ground_truth"] == "1000" and seed["prompts"][0]["question_id"] == "gsm8k/train/0"
    )
    stats = httpx.get(url + "/stats").json()
    default = httpx.get(url + "/prompts", params={"batch_size": 1}).json()
    # /stats counts what /prompts serves by default (the first dataset's train split), as the seed did
    assert stats["dataset"] == "gsm8k" and stats["total_prompts"] == default["total_available"] == 30
    assert stats["datasets"]["gsm8k"] == {"train": 30, "test": 10}
    assert httpx.get(url + "/prompts", params={"batch_size": 0}).status_code == 422
    assert 'route="/v1/batches"' in httpx.get(url + "/metrics").text


def test_async_client_walks_batches(servers):
    url, _ = servers

    async def run():
        async with DataClient(url) as client:
            await client.wait_healthy(5)
            first = await client.batch("synthetic-arith", "train", 4)
            second = await client.batch("synthetic-arith", "train", 4, first.next_cursor)
            return first, second

    first, second = asyncio.run(run())
    assert first.items[0].data_source == "synthetic-arith" and second.offset == 4


def test_missing_data_file_is_one_line_and_nonzero_exit(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "services.data_server", "--port", "0", "--datasets", f"gsm8k={tmp_path}/nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path}/nope does not exist"]


def test_unreadable_rows_fail_the_load_with_one_clear_line(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "no final line"}\n')
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.data_server",
            "--port",
            "0",
            "--datasets",
            f"bad={tmp_path}",
            "--log-format",
            "text",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "row 0" in errors[0] and "####" in errors[0]
    assert "Traceback" not in result.stderr


def test_qa_math_and_verl_sources(tmp_path):
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "test.jsonl").write_text(
        json.dumps({"id": "q0", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"]}) + "\n"
    )
    (tmp_path / "math.jsonl").write_text(
        json.dumps({"problem": "1/2 of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}) + "\n"
    )
    settings = DataServerSettings(datasets=[f"nq={tmp_path / 'qa'}", f"math={tmp_path / 'math.jsonl'}"])
    with TestClient(create_app(settings)) as client:
        while client.get("/health").status_code != 200:
            pass
        qa = client.post("/v1/batches", json={"dataset": "nq", "split": "test", "batch_size": 1}).json()[
            "items"
        ][0]
        assert qa["data_source"] == "nq" and qa["reward_model"]["ground_truth"] == {"target": ["Shakespeare"]}
        assert "<search>" in qa["prompt"][0]["content"] and qa["prompt"][0]["content"].endswith(
            "who wrote hamlet?\n"
        )
        math = client.post("/v1/batches", json={"dataset": "math", "batch_size": 1}).json()["items"][0]
        assert math["reward_model"]["ground_truth"] == "\\frac{1}{2}"
        assert math["prompt"][0]["content"].endswith("\\boxed{}.")


def test_qa_instruction_tools_asks_for_the_tools_instead_of_search_r1_tags(tmp_path):
    # with the hermes tool format (the code tool), prompts that teach <search> tags leave the search tool
    # uncalled: --qa-instruction tools serves the same questions and answers with a tools instruction,
    # rebuilding verl QA rows (Search-R1's nq_hotpotqa) from their question; other rows stay as they are
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "test.jsonl").write_text(
        json.dumps({"id": "q0", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"]}) + "\n"
    )
    search_r1_row = {
        "data_source": "hotpotqa",
        "question": "capital of italy",
        "prompt": [
            {"role": "user", "content": "Answer ... <search> query </search> ... Question: capital of italy?"}
        ],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["Rome"]}},
        "extra_info": {"split": "train", "index": 7},
    }
    math_row = {
        "data_source": "custom",
        "prompt": [{"role": "user", "content": "1+1? <search> stays </search>"}],
        "reward_model": {"style": "rule", "ground_truth": "2"},
    }
    (tmp_path / "verl").mkdir()
    (tmp_path / "verl" / "test.jsonl").write_text(
        json.dumps(search_r1_row) + "\n" + json.dumps(math_row) + "\n"
    )
    specs = [f"nq={tmp_path / 'qa'}", f"mixed={tmp_path / 'verl'}"]
    served = {}
    for instruction in ("search_r1", "tools"):
        settings = DataServerSettings(datasets=specs, qa_instruction=instruction)
        with TestClient(create_app(settings)) as client:
            while client.get("/health").status_code != 200:
                pass
            for name in ("nq", "mixed"):
                body = {"dataset": name, "split": "test", "batch_size": 2 if name == "mixed" else 1}
                items = client.post("/v1/batches", json=body).json()["items"]
                served[instruction, name] = sorted(items, key=lambda row: row["extra_info"]["index"])
    nq_tools, nq_search = served["tools", "nq"][0], served["search_r1", "nq"][0]
    assert "<search>" in nq_search["prompt"][0]["content"]
    assert "<search>" not in nq_tools["prompt"][0]["content"]
    assert "call the tools" in nq_tools["prompt"][0]["content"]
    assert nq_tools["prompt"][0]["content"].endswith("who wrote hamlet?\n")
    assert nq_tools["reward_model"] == nq_search["reward_model"]
    assert nq_tools["extra_info"]["scorer"] == "qa_em"
    verl_math, verl_qa = served["tools", "mixed"]  # by extra_info.index: the QA row's is its own 7
    assert verl_qa["prompt"][0]["content"].endswith("capital of italy?\n")
    assert (
        "<search>" not in verl_qa["prompt"][0]["content"]
        and "call the tools" in verl_qa["prompt"][0]["content"]
    )
    assert verl_qa["data_source"] == "hotpotqa" and verl_qa["reward_model"]["ground_truth"] == {
        "target": ["Rome"]
    }
    assert verl_math["prompt"] == math_row["prompt"]  # not a QA row: its prompt is its author's
    assert served["search_r1", "mixed"][1]["prompt"] == search_r1_row["prompt"]


def test_qa_instruction_tools_keeps_and_reports_qa_rows_it_cannot_rebuild(caplog):
    from services.data_server.sources import build_rows

    no_question = {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": "<search> ... Question: who?"}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["x"]}},
    }
    with caplog.at_level("WARNING", logger="services.data_server"):
        _, _, rows = build_rows([no_question], "train", "nq", "tools")
    assert rows[0]["prompt"] == no_question["prompt"]
    assert "1 QA rows have no question field" in caplog.text


def test_hub_probe_timeout_reaches_the_probe_of_a_named_hub_dataset(monkeypatch):
    """--hub-probe-timeout-s bounded only the probe for the default datasets; a hub dataset named with
    --datasets was probed with the library's 3 s whatever the setting said."""
    import datasets

    from services.data_server import sources

    probes = []
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout_s=3.0: probes.append(timeout_s) or False)

    def not_cached(*args, **kwargs):
        raise FileNotFoundError("not in the cache")

    monkeypatch.setattr(datasets, "load_dataset", not_cached)
    settings = DataServerSettings(datasets=["gsm8k=hub:openai/gsm8k"], hub_probe_timeout_s=0.25)
    with TestClient(create_app(settings)) as client:
        health = client.get("/health").json()
        for _ in range(100):
            if health["status"] != "loading":
                break
            time.sleep(0.05)
            health = client.get("/health").json()
    assert health["status"] == "failed" and "hub is unreachable" in health["error"]
    assert probes == [0.25]  # the old code probed with 3.0


def test_synthetic_problems_are_consistent():
    for difficulty in ("easy", "medium", "hard"):
        for index in range(200):
            problem = make_problem(3, "train", index, difficulty)
            assert problem.answer.endswith(f"#### {problem.result}")
            assert problem.result > 0
            for line in problem.answer.splitlines()[:-1]:  # each worked step's arithmetic is right
                expr, _, value = line.partition("<<")[2].partition(">>")[0].partition("=")
                assert eval(expr.replace("/", "//")) == int(value)
    assert make_problem(3, "train", 5) == make_problem(3, "train", 5)
    assert make_problem(3, "train", 5) != make_problem(4, "train", 5)


def test_export_writes_verls_schema(gsm8k_dir, tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "services.data_server",
            "export",
            "gsm8k",
            "--source",
            str(gsm8k_dir),
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    table = pq.read_table(tmp_path / "train.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    schema = table.schema
    assert schema.field("data_source").type == pa.string()
    assert schema.field("prompt").type == pa.list_(
        pa.struct([("content", pa.string()), ("role", pa.string())])
    )
    assert schema.field("reward_model").type == pa.struct(
        [("ground_truth", pa.string()), ("style", pa.string())]
    )
    assert schema.field("extra_info").type == pa.struct(
        [("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("split", pa.string())]
    )
    row = table.to_pylist()[3]
    assert row["reward_model"] == {"ground_truth": "1003", "style": "rule"}
    assert row["extra_info"]["index"] == 3 and row["extra_info"]["split"] == "train"
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 10


@pytest.mark.skipif(not (SHARED_DATA / "gsm8k" / "train.jsonl").exists(), reason="../shared/data not present")
def test_real_gsm8k_from_shared_data():
    settings = DataServerSettings(datasets=[f"gsm8k={SHARED_DATA / 'gsm8k'}"])
    with TestClient(create_app(settings)) as client:
        while client.get("/health").status_code != 200:
            pass
        assert client.get("/v1/datasets").json()["datasets"][0]["splits"] == {"test": 1319, "train": 7473}
        items = client.post("/v1/batches", json={"dataset": "gsm8k", "batch_size": 256}).json()["items"]
        assert all(
            item["reward_model"]["ground_truth"].lstrip("-").replace(".", "").isdigit() for item in items
        )


def test_sigterm_drains_and_exits_cleanly():
    import time

    from tests.helpers import output_of, small_data_server, stop_process

    with small_data_server() as (url, proc):
        assert httpx.post(url + "/v1/batches", json={"batch_size": 2}).status_code == 200
        started = time.monotonic()
        assert stop_process(proc) == 0  # SIGTERM: uvicorn drains, runs the lifespan shutdown, exits 0
        assert time.monotonic() - started < 10
        output = output_of(proc)
    assert "Finished server process" in output or "shutdown" in output.lower()
