"""The agent loop against a real retrieval-server (a BM25 index the build CLI made, served by
`python -m services.retrieval_server`), over the real replica pool and rollout manager. The "model"
is a scripted policy (testing/search.py): fixed turns, so every token of a trajectory is known.

Checked: the loss mask is 0 on exactly the tool tokens; trajectories with 0, 1 and several calls in
both formats; every turn's input is the previous context token for token; truncation of tool
responses; the turn and length limits; calls that cannot run; queries of waiting trajectories in one
/retrieve; the server killed mid-rollout (the step goes on, tool/errors counts it).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from services.retrieval_server.client import RetrievalClient
from testing.search import CORPUS, QA_ROWS, ScriptedReplica, write_corpus
from testing.tiny import load_tiny_tokenizer
from tests.helpers import ROOT, service_process, stop_process
from trainer.agent.formats import make_format
from trainer.agent.loop import AgentLoop, AgentSettings
from trainer.agent.search import SearchBatcher, SearchTool
from trainer.agent.tools import SEARCH_TOOL_SCHEMA
from trainer.rollout.base import SamplingParams
from trainer.rollout.manager import RolloutManager
from trainer.rollout.pool import ReplicaPool

CONTENTS = {row["id"]: row["contents"] for row in CORPUS}
ASSISTANT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent-index")
    corpus = write_corpus(folder / "corpus.jsonl")
    done = subprocess.run(
        [sys.executable, "-m", "services.retrieval_server", "build", "--corpus", str(corpus), "--out",
         str(folder / "bm25"), "--index", "bm25", "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "bm25"


def serve(index):
    return service_process(
        "services.retrieval_server", "serve", "--index", str(index), "--log-level", "warning"
    )


@pytest.fixture(scope="module")
def retrieval(index):
    with serve(index) as (url, _):
        yield url


@pytest.fixture(scope="module")
def tokenizers():
    return {"char": load_tiny_tokenizer("char"), "qwen": load_tiny_tokenizer("qwen")}


# ------------------------------------------------------------------------------------------ policies


def search_turn(fmt: str, query: str) -> str:
    if fmt == "search_r1":
        return f"<think>I should look this up.</think>\n<search> {query} </search>"
    call = {"name": "search", "arguments": {"query_list": [query]}}
    return f"Let me search.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def answer_turn(fmt: str, answer: str) -> str:
    return (
        f"<answer> {answer} </answer>" if fmt == "search_r1" else f"The answer is <answer> {answer} </answer>"
    )


def results_seen(fmt: str, context: str) -> int:
    """Tool responses in the context after the prompt (the prompt may quote the tags itself)."""
    response = context.split(ASSISTANT, 1)[1]
    return response.count("</information>") if fmt == "search_r1" else response.count('{"result":')


def planned(fmt: str, plans: dict[str, list[str]], answers: dict[str, str]):
    """Per question (found in the prompt): search these queries in turn, then answer."""

    def policy(context: str) -> str:
        question = next(q for q in plans if q in context)
        done = results_seen(fmt, context)
        if done < len(plans[question]):
            return search_turn(fmt, plans[question][done])
        return answer_turn(fmt, answers[question])

    return policy


def prompt_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": f"Answer with the search tool. Question: {question}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_agent(
    tokenizer,
    policy,
    prompts: list[list[int]],
    urls: list[str],
    *,
    fmt: str = "search_r1",
    n: int = 1,
    client_kwargs: dict | None = None,
    max_queries: int = 512,
    **settings,
):
    """One AgentLoop.generate over a ScriptedReplica behind a real pool and manager."""
    replica = ScriptedReplica(tokenizer, policy)
    settings = {"max_response_length": 2048, "max_tool_response_length": 512, **settings}

    async def go():
        manager = RolloutManager(ReplicaPool([replica]), pad_id=tokenizer.pad_token_id)
        client = RetrievalClient(urls, **(client_kwargs or {}))
        search = SearchTool(
            SearchBatcher(client, topk=2, max_queries=max_queries), SEARCH_TOOL_SCHEMA, style=fmt
        )
        loop = AgentLoop(manager, tokenizer, make_format(fmt, tokenizer), [search], AgentSettings(**settings))
        try:
            return await loop.generate(prompts, SamplingParams(n=n, max_new_tokens=1))
        finally:
            await loop.aclose()
            await asyncio.to_thread(manager.close)

    return asyncio.run(go()), replica


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal loss-mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("fmt, tok", [("search_r1", "char"), ("search_r1", "qwen"), ("hermes", "qwen")])
def test_zero_one_and_several_calls_mask_exactly_the_tool_tokens(retrieval, tokenizers, fmt, tok):
    tokenizer = tokenizers[tok]
    river, composer, peak = QA_ROWS[0], QA_ROWS[5], QA_ROWS[10]  # gold passages d0, d5, d10
    plans = {
        river["question"]: [],
        composer["question"]: ["Callow composer year"],
        peak["question"]: ["Mount Darsk", "Darsk volcano height", "Quillon scouts"],
    }
    answers = {row["question"]: row["golden_answers"][0] for row in (river, composer, peak)}
    prompts = [prompt_ids(tokenizer, q) for q in plans]
    batch, replica = run_agent(tokenizer, planned(fmt, plans, answers), prompts, [retrieval], fmt=fmt, n=2)

    assert [r.prompt_index for r in batch.rollouts] == [0, 0, 1, 1, 2, 2]  # n per prompt, in prompt order
    assert [t.tool_calls for t in batch.trajectories] == [0, 0, 1, 1, 3, 3]
    # num_turns counts the prompt, the model's turns and the tool turns (verl): 2, 4 and 8
    assert [t.num_turns for t in batch.trajectories] == [2, 2, 4, 4, 8, 8]
    metrics = batch.metrics()
    assert metrics["num_turns/max"] == 8 and metrics["num_turns/min"] == 2
    assert metrics["tool_calls/mean"] == pytest.approx(8 / 6) and metrics["tool_calls/max"] == 3
    assert metrics["tool/errors"] == 0 and metrics["tool/invalid_calls"] == 0

    outputs = {tuple(out) for out in replica.outputs}
    for rollout, trajectory in zip(batch.rollouts, batch.trajectories):
        assert len(rollout.response_ids) == len(rollout.logprobs) == len(rollout.loss_mask)
        segments = runs(rollout.loss_mask)
        model = [rollout.response_ids[a:b] for value, a, b in segments if value == 1]
        tools = [rollout.response_ids[a:b] for value, a, b in segments if value == 0]
        # every trained run is exactly one turn the policy produced; every other token is tool text
        assert all(tuple(ids) in outputs for ids in model) and len(model) == trajectory.assistant_turns
        assert len(tools) == trajectory.tool_turns == trajectory.tool_calls
        assert all(rollout.logprobs[i] == -0.5 for i, m in enumerate(rollout.loss_mask) if m)
        assert all(rollout.logprobs[i] == 0.0 for i, m in enumerate(rollout.loss_mask) if not m)
        for ids in tools:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            if fmt == "search_r1":
                assert text.startswith("\n\n<information>Doc 1(Title: ") and text.endswith(
                    "</information>\n\n"
                )
            else:
                body = text.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
                assert json.loads(body)["result"].startswith("Doc 1 (Title: ")
                assert text.startswith("<|im_end|>") and text.endswith(ASSISTANT)
    # the real passages came back: the composer's and the volcano's gold passages are in the responses
    composer_text = tokenizer.decode(batch.rollouts[2].response_ids)
    assert CONTENTS["d5"].split("\n")[1] in composer_text
    assert CONTENTS["d10"].split("\n")[1] in tokenizer.decode(batch.rollouts[4].response_ids)


def test_each_turn_sees_the_context_token_for_token(retrieval, tokenizers):
    tokenizer = tokenizers["qwen"]
    question = QA_ROWS[2]["question"]
    policy = planned("hermes", {question: ["Mount Korrath", "Korrath height"]}, {question: "900"})
    prompt = prompt_ids(tokenizer, question)
    batch, replica = run_agent(tokenizer, policy, [prompt], [retrieval], fmt="hermes")
    (rollout,) = batch.rollouts
    starts = [a for value, a, _ in runs(rollout.loss_mask) if value == 1]
    assert len(replica.requests) == len(starts) == 3
    for (input_ids, params), start in zip(replica.requests, starts):
        # no decode/re-encode between turns: the ids sent are the prompt plus what was appended, exactly
        assert input_ids == prompt + rollout.response_ids[:start]
        assert params["max_new_tokens"] == 2048 - start and params["stop"] == ["</tool_call>"]


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_tool_responses_are_truncated_to_the_token_cap(retrieval, tokenizers, side):
    tokenizer = tokenizers["char"]
    question = QA_ROWS[0]["question"]
    policy = planned("search_r1", {question: ["Norvik River"]}, {question: "Amber"})
    prompt = [prompt_ids(tokenizer, question)]

    def information(**settings) -> list[int]:
        batch, _ = run_agent(tokenizer, policy, prompt, [retrieval], **settings)
        rollout = batch.rollouts[0]
        (_, a, b) = next(seg for seg in runs(rollout.loss_mask) if seg[0] == 0)
        open_ids, close_ids = tokenizer.encode("\n\n<information>"), tokenizer.encode("</information>\n\n")
        ids = rollout.response_ids[a:b]
        assert ids[: len(open_ids)] == open_ids and ids[-len(close_ids) :] == close_ids
        return ids[len(open_ids) : -len(close_ids)]

    full = information()
    cut = information(max_tool_response_length=40, tool_response_truncate_side=side)
    assert len(full) > 100  # two passages, char tokens
    marker = {"left": "...(truncated)", "right": "(truncated)...", "middle": "...(truncated)..."}[side]
    expected = {
        "left": full[:40] + tokenizer.encode(marker),
        "right": tokenizer.encode(marker) + full[-40:],
        "middle": full[:20] + tokenizer.encode(marker) + full[-20:],
    }[side]
    assert cut == expected


def test_a_trajectory_stops_at_the_turn_limit(retrieval, tokenizers):
    tokenizer = tokenizers["char"]

    def always_search(context: str) -> str:
        return search_turn("search_r1", "Norvik River")

    prompt = [prompt_ids(tokenizer, QA_ROWS[0]["question"])]
    batch, replica = run_agent(tokenizer, always_search, prompt, [retrieval], max_assistant_turns=3)
    (trajectory,) = batch.trajectories
    assert (trajectory.assistant_turns, trajectory.tool_turns, trajectory.tool_calls) == (3, 2, 2)
    assert len(replica.requests) == 3 and trajectory.loss_mask[-1] == 1


def test_a_trajectory_stops_within_the_response_length(retrieval, tokenizers):
    tokenizer = tokenizers["char"]

    def always_search(context: str) -> str:
        return search_turn("search_r1", "Amber Sea whales")

    prompt = [prompt_ids(tokenizer, QA_ROWS[3]["question"])]
    batch, replica = run_agent(
        tokenizer, always_search, prompt, [retrieval], max_response_length=700, max_tool_response_length=120
    )
    (rollout,) = batch.rollouts
    (trajectory,) = batch.trajectories
    assert len(rollout.response_ids) <= 700 and trajectory.tool_calls >= 2
    # the last tokens are the model's: a tool response that would leave no room for a turn is not added
    assert rollout.loss_mask[-1] == 1
    for (_, params), (_, start, _) in zip(replica.requests, [s for s in runs(rollout.loss_mask) if s[0]]):
        assert params["max_new_tokens"] == 700 - start  # each turn may only use what is left


def test_calls_that_cannot_run_are_answered_and_the_trajectory_goes_on(retrieval, tokenizers):
    tokenizer = tokenizers["qwen"]
    question = QA_ROWS[1]["question"]
    turns = iter(
        [
            '<tool_call>{"name": "search", "arguments": {"query_list": [}}</tool_call>',
            '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>',
            search_turn("hermes", "Dunmere composer"),
            answer_turn("hermes", "1600"),
        ]
    )
    batch, _ = run_agent(
        tokenizer, lambda context: next(turns), [prompt_ids(tokenizer, question)], [retrieval], fmt="hermes"
    )
    (trajectory,) = batch.trajectories
    assert (trajectory.tool_calls, trajectory.invalid_calls, trajectory.tool_errors) == (3, 2, 0)
    text = tokenizer.decode(batch.rollouts[0].response_ids)
    assert "not valid JSON" in text and "unknown tool 'calculator'" in text and "1600" in text
    assert batch.metrics()["tool/invalid_calls"] == 2


def test_searches_of_waiting_trajectories_share_one_request(retrieval, tokenizers):
    queries = [row["question"] for row in QA_ROWS[:6]]

    async def go(max_queries: int):
        searcher = SearchBatcher(RetrievalClient(retrieval), topk=1, max_queries=max_queries)
        try:
            outcomes = await asyncio.gather(*(searcher.search([q]) for q in queries))
            return outcomes, searcher.take_stats()
        finally:
            await searcher.aclose()

    outcomes, stats = asyncio.run(go(512))
    # six trajectories asking at once: one /retrieve with their six queries, answers routed back
    assert (stats.requests, stats.queries, stats.calls) == (1, 6, 6)
    assert [o.hits[0][0].document.id for o in outcomes] == [row["gold"] for row in QA_ROWS[:6]]
    _, capped = asyncio.run(go(4))
    assert (capped.requests, capped.queries) == (2, 6)  # the server's per-request limit is respected


def test_calls_arriving_during_a_request_go_together_in_the_next(retrieval):
    class GatedClient(RetrievalClient):
        """The real client, held at a gate so the test decides when the first request may go."""

        gate: asyncio.Event

        async def retrieve(self, queries, topk=3, return_scores=True):
            await self.gate.wait()
            return await super().retrieve(queries, topk, return_scores)

    async def go():
        client = GatedClient(retrieval)
        client.gate = asyncio.Event()
        searcher = SearchBatcher(client, topk=1)
        first = asyncio.ensure_future(searcher.search(["Norvik River"]))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the first request has left and waits at the gate
        later = [asyncio.ensure_future(searcher.search([row["question"]])) for row in QA_ROWS[4:8]]
        await asyncio.sleep(0)
        client.gate.set()
        await asyncio.gather(first, *later)
        stats = searcher.take_stats()
        await searcher.aclose()
        return stats

    stats = asyncio.run(go())
    assert (stats.requests, stats.queries) == (2, 5)


def test_server_killed_mid_rollout_the_rollout_goes_on(index, tokenizers):
    tokenizer = tokenizers["char"]
    question = QA_ROWS[5]["question"]  # the composer Callow, born 1617
    with serve(index) as (url, proc):

        def policy(context: str) -> str:
            done = results_seen("search_r1", context)
            if done == 1 and proc.poll() is None:
                stop_process(proc)  # the retrieval-server dies after answering the first search
            if done < 3:
                return search_turn("search_r1", ["Callow composer", "Callow year", "Callow born"][done])
            return answer_turn("search_r1", "1617")

        prompts = [prompt_ids(tokenizer, question)]
        client = {"retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.05, "timeout_s": 5}
        batch, _ = run_agent(tokenizer, policy, prompts, [url], n=2, client_kwargs=client)
    for trajectory, rollout in zip(batch.trajectories, batch.rollouts):
        assert trajectory.tool_calls == 3 and trajectory.assistant_turns == 4
        text = tokenizer.decode(rollout.response_ids)
        assert text.endswith("<answer> 1617 </answer>")
    # the first turn-2 call kills the server, so every second and third search fails; a first search
    # may fail too if it went in a request of its own after the other trajectory's
    errors = sum(t.tool_errors for t in batch.trajectories)
    assert 4 <= errors <= 5 and batch.metrics()["tool/errors"] == errors
    assert "The search failed (the retrieval service did not answer)" in tokenizer.decode(
        batch.rollouts[0].response_ids
    )
