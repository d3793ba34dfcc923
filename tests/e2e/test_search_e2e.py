"""GRPO with search, end to end on CPU: `python -m jobgroup.local run` starts the data-, reward- and
retrieval-servers (a BM25 index built by the launcher from a corpus: the HotpotQA slice of
../shared/data/wiki where it is at hand, plus the test's own documents) and trains a tiny model whose
rollouts call the search tool through the agent loop, on two Ray ranks (each rank's engine a replica of
the rollout manager, the trajectories' turns spread over both).

A random model never writes a tool call, so the fixture first teaches the tiny model Search-R1's
format on a few prompts (testing/search.py): `<search> river </search>`, then `<answer> 7 </answer>`
or `<answer> 9 </answer>` after the search results. Only 7 is right, so GRPO has a signal.
The prompts are verl rows with a short question: Search-R1's own instruction is ~500 characters,
which the data-server adds to QA rows (tested with the services); this keeps the CPU run to seconds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from testing.search import (
    SEARCH_RESULT_TOKENS,
    short_search_row,
    taught_run_keys,
    teach_search_format,
    write_corpus,
    write_search_rows,
)
from testing.tiny import make_tiny_model
from tests.helpers import ROOT

INFORMATION = re.compile(r"\n\n<information>.*?</information>\n\n", re.DOTALL)


@pytest.fixture(scope="module")
def searcher(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0, tokenizer="char")
    teach_search_format(folder, [short_search_row(i) for i in range(6)])
    return folder


def test_grpo_steps_with_search_through_the_three_services(searcher, tmp_path):
    data = write_search_rows(tmp_path / "search", train=range(6, 38), test=range(4))
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    hotpot = ROOT.parent / "shared" / "data" / "wiki" / "hotpot_dev100_corpus.jsonl"
    if hotpot.exists():
        with corpus.open("a") as out:
            out.write(hotpot.read_text())
    launcher = [
        sys.executable, "-m", "jobgroup.local", "run", "--run-dir", str(tmp_path / "group"),
        "--data-port", "0", "--reward-port", "0", "--retrieval-port", "0", "--health-timeout", "300",
        "--data-server-args", f"--datasets search={data}",
        "--retrieval-corpus", str(corpus), "--retrieval-build-args", "--index bm25",
    ]  # fmt: skip
    # the search results as the model was taught them: their first 13 tokens (testing/search.py)
    trainer = taught_run_keys(
        searcher, "search", tmp_path, response_length=128, tool_tokens=SEARCH_RESULT_TOKENS
    )
    trainer += [
        "actor_rollout_ref.rollout.multi_turn.format=search_r1",
        "trainer.nnodes=2",  # two Ray ranks, each with its engine behind the rollout manager
    ]
    done = subprocess.run(
        launcher + trainer, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False
    )
    assert done.returncode == 0, done.stdout[-5000:]
    assert "multi_turn.enable=true" in done.stdout  # the launcher turned search on for the retrieval-server
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "tool_calls/mean" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["tool_calls/mean"] > 0 and row["num_turns/max"] >= 4  # prompt, search, results, answer
        assert row["tool/errors"] == 0 and row["timing_s/tool_calls"] > 0
        assert 1 <= row["tool/retrieve_requests"] <= row["tool_calls/mean"] * 16  # a request serves >= 1 call
        assert row["actor/grad_norm"] > 0  # the answers' rewards varied: a real update
        assert row["perf/throughput"] > 0
    for step, row in enumerate(steps, start=1):
        responses = [
            json.loads(line)["response"]
            for line in (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        ]
        assert len(responses) == 16 and any("<information>Doc 1(Title: " in r for r in responses)
        # response_length counts the model's tokens (one per character here), not the search results;
        # a turn that ended on <|im_end|> has one token more than its text shows
        model_chars = [len(INFORMATION.sub("", r)) for r in responses]
        assert sum(model_chars) / 16 <= row["response_length/mean"] <= sum(model_chars) / 16 + 1
        assert sum(len(r) for r in responses) / 16 > row["response_length/mean"] + 20
