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
import contextlib
import dataclasses
import json
import subprocess
import sys

import pytest

from services.retrieval_server.client import RetrievalClient
from testing.search import CORPUS, QA_ROWS, ScriptedReplica, write_corpus
from testing.tiny import load_tiny_tokenizer
from tests.helpers import ROOT, free_port, service_process, stop_process
from trainer.agent.build import agent_tools, build_agent, chat_template_tools
from trainer.agent.formats import make_format
from trainer.agent.loop import AgentBatch, AgentLoop, AgentSettings
from trainer.agent.code import CodeExecutorClient, CodeTool
from trainer.agent.search import SearchBatcher, SearchTool
from trainer.agent.tools import SEARCH_TOOL_SCHEMA, CodeToolSpec, ToolSet
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
    code_url: str | None = None,
    max_parallel_calls: int = 1,
    on_group=None,
    **settings,
):
    """One AgentLoop.generate over a ScriptedReplica behind a real pool and manager; with code_url, the
    code tool (on the code-executor there) beside the search; on_group: as the fit loop's scoring."""
    replica = ScriptedReplica(tokenizer, policy)
    settings = {"max_response_length": 2048, "max_tool_response_length": 512, **settings}

    async def go():
        manager = RolloutManager(ReplicaPool([replica]))
        client = RetrievalClient(urls, **(client_kwargs or {}))
        tools = [
            SearchTool(SearchBatcher(client, topk=2, max_queries=max_queries), SEARCH_TOOL_SCHEMA, style=fmt)
        ]
        if code_url is not None:
            spec = CodeToolSpec(urls=(code_url,), timeout_s=5)
            tools.append(CodeTool(CodeExecutorClient(code_url, retries=0, timeout_s=20), spec))
        names = [tool.name for tool in tools]
        tool_format = make_format(fmt, tokenizer, max_parallel_calls=max_parallel_calls, tool_names=names)
        settings["max_parallel_calls"] = max_parallel_calls
        loop = AgentLoop(manager, tokenizer, tool_format, tools, AgentSettings(**settings))
        try:
            return await loop.generate(prompts, SamplingParams(n=n, max_new_tokens=1), on_group=on_group)
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
        segments = runs(rollout.loss_mask.tolist())
        model = [rollout.response_ids.tolist()[a:b] for value, a, b in segments if value == 1]
        tools = [rollout.response_ids.tolist()[a:b] for value, a, b in segments if value == 0]
        # every trained run is exactly one turn the policy produced; every other token is tool text
        assert all(tuple(ids) in outputs for ids in model) and len(model) == trajectory.assistant_turns
        assert len(tools) == trajectory.tool_turns == trajectory.tool_calls
        assert all(lp == -0.5 for lp, m in zip(rollout.logprobs.tolist(), rollout.loss_mask.tolist()) if m)
        assert all(lp == 0.0 for lp, m in zip(rollout.logprobs.tolist(), rollout.loss_mask.tolist()) if not m)
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
    starts = [a for value, a, _ in runs(rollout.loss_mask.tolist()) if value == 1]
    assert len(replica.requests) == len(starts) == 3
    for (input_ids, params), start in zip(replica.requests, starts):
        # no decode/re-encode between turns: the ids sent are the prompt plus what was appended, exactly
        assert input_ids == prompt + rollout.response_ids.tolist()[:start]
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
        (_, a, b) = next(seg for seg in runs(rollout.loss_mask.tolist()) if seg[0] == 0)
        open_ids, close_ids = tokenizer.encode("\n\n<information>"), tokenizer.encode("</information>\n\n")
        ids = rollout.response_ids.tolist()[a:b]
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
    for (_, params), (_, start, _) in zip(
        replica.requests, [s for s in runs(rollout.loss_mask.tolist()) if s[0]]
    ):
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
        batch.rollouts[0].response_ids.tolist()
    )


def test_a_search_sent_while_its_server_is_down_waits_for_it_within_services_retry_deadline_s(index):
    """services.retry_deadline_s holds for the tools' clients as for the data and reward clients: a
    search sent to a retrieval-server that is not listening yet (connections refused; retries=0, so
    no quick retries) is tried again every few seconds and answered once the server is up. Without the
    deadline it failed at the first refusal."""
    from trainer.agent.build import tool_runner
    from trainer.agent.tools import SearchToolSpec
    from trainer.config.run import ServicesConfig

    port = free_port()
    services = ServicesConfig(retries=0, retry_deadline_s=120.0)

    async def go():
        tool = tool_runner(SearchToolSpec(urls=(f"http://127.0.0.1:{port}",)), "search_r1", services)
        with contextlib.ExitStack() as server:
            try:
                call = asyncio.create_task(tool.call({"query_list": ["Callow composer"]}))
                await asyncio.sleep(1.0)
                assert not call.done()  # refused, and waiting for the next try
                started = service_process(
                    "services.retrieval_server", "serve", "--index", str(index), "--log-level", "warning",
                    port=port,
                )  # fmt: skip
                await asyncio.to_thread(server.enter_context, started)
                return await asyncio.wait_for(call, 60), tool.batcher.take_stats()
            finally:
                await tool.aclose()

    result, stats = asyncio.run(go())
    assert result.status == "ok" and "Callow" in result.text
    assert (stats.requests, stats.failed_calls) == (1, 0)


# ------------------------------------------------------------------------------------------ several tools


def code_turn(*programs: str) -> str:
    calls = [{"name": "code_interpreter", "arguments": {"code": code}} for code in programs]
    return "Let me compute.\n" + "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def tool_responses(tokenizer, rollout) -> list[str]:
    """The bodies of every <tool_response> in a rollout, in order."""
    text = tokenizer.decode(rollout.response_ids, skip_special_tokens=False)
    return [part.split("\n</tool_response>", 1)[0] for part in text.split("<tool_response>\n")[1:]]


def dead_url() -> str:
    """A loopback port nobody listens on: a service that is down (connections refused)."""
    return f"http://127.0.0.1:{free_port()}"


def test_the_model_may_call_either_tool_in_any_turn(retrieval, tokenizers):
    """Search and code in one turn, then code alone, then the answer: each call goes to its tool. The
    code-executor is down here, so its calls fail (the real one: test_both_tools_on_the_real_services)."""
    tokenizer = tokenizers["qwen"]
    question = QA_ROWS[5]["question"]  # the composer Callow, born 1617
    search = search_turn("hermes", "Callow composer")
    turns = {0: search + "\n" + code_turn("print(1617 + 17)").split("\n", 1)[1], 2: code_turn("print(2)")}

    def policy(context: str) -> str:
        return turns.get(context.count("<tool_response>"), answer_turn("hermes", "1617"))

    batch, _ = run_agent(
        tokenizer, policy, [prompt_ids(tokenizer, question)], [retrieval], fmt="hermes", code_url=dead_url(),
        max_parallel_calls=2,
    )  # fmt: skip
    (trajectory,) = batch.trajectories
    assert (trajectory.tool_calls, trajectory.tool_turns, trajectory.assistant_turns) == (3, 2, 3)
    assert (trajectory.tool_errors, trajectory.invalid_calls) == (2, 0) and trajectory.failed_tool
    found, code, code_again = tool_responses(tokenizer, batch.rollouts[0])
    # the responses come back in the order of the calls: the passages, then the run's failure
    assert json.loads(found)["result"].startswith('Doc 1 (Title: "Callow (composer)")')
    assert code == code_again == "Execution failed: the code-executor did not answer"
    metrics = batch.metrics()
    assert (metrics["tool/search/calls"], metrics["tool/search/errors"]) == (1, 0)
    assert (metrics["tool/code_interpreter/calls"], metrics["tool/code_interpreter/errors"]) == (2, 2)
    assert metrics["tool/errors"] == 2 and metrics["tool/failed_trajectories"] == 1
    assert metrics["timing_s/tool_calls/search"] > 0 and metrics["timing_s/tool_calls/code_interpreter"] > 0
    # text policy (the default): the failure is the tool response, nothing is dropped, but the batch says
    # which prompt saw a failure
    assert batch.failed_prompts == [0] and metrics["tool/dropped_groups"] == 0


@pytest.mark.parametrize(
    "policy_settings, healthy, retries, errors",
    [
        ({"tool_failure": "text"}, True, 0, 1),  # the first replica is down: its failure is the response
        ({"tool_failure": "retry", "tool_failure_retries": 2, "retry_backoff_s": 0.0}, True, 1, 0),
        ({"tool_failure": "retry", "tool_failure_retries": 2, "retry_backoff_s": 0.0}, False, 2, 1),
    ],
)
def test_retry_runs_a_failed_call_again_then_falls_back_to_text(
    retrieval, tokenizers, policy_settings, healthy, retries, errors
):
    """The client does not retry (retries=0) and round-robins two replicas: the first request goes to a
    dead one, which then cools down, so the retry reaches the live one. Without a live one the retries
    run out and the failure text is the response."""
    tokenizer = tokenizers["qwen"]
    question = QA_ROWS[0]["question"]
    urls = [dead_url(), retrieval if healthy else dead_url()]
    batch, _ = run_agent(
        tokenizer,
        planned("hermes", {question: ["Norvik River"]}, {question: "Amber"}),
        [prompt_ids(tokenizer, question)],
        urls,
        fmt="hermes",
        client_kwargs={"retries": 0, "timeout_s": 5},
        **policy_settings,
    )
    (trajectory,) = batch.trajectories
    (response,) = tool_responses(tokenizer, batch.rollouts[0])
    metrics = batch.metrics()
    assert metrics["tool/search/retries"] == retries and metrics["tool/search/errors"] == errors
    assert trajectory.tool_errors == errors and trajectory.failed_tool == bool(errors)
    if errors:
        assert json.loads(response) == {"result": "Search error: the retrieval service did not answer"}
    else:
        assert json.loads(response)["result"].startswith('Doc 1 (Title: "Norvik River")')
    assert trajectory.assistant_turns == 2  # the trajectory went on to its answer either way


def test_drop_group_ends_the_failed_trajectories_and_names_their_prompt(retrieval, tokenizers):
    tokenizer = tokenizers["qwen"]
    river, composer = QA_ROWS[0], QA_ROWS[5]

    def policy(context: str) -> str:
        if river["question"] in context:  # searches (the retrieval-server is up), then answers
            return planned("hermes", {river["question"]: ["Norvik River"]}, {river["question"]: "Amber"})(
                context
            )
        return code_turn("print(1617)") if "<tool_response>" not in context else answer_turn("hermes", "1617")

    prompts = [prompt_ids(tokenizer, row["question"]) for row in (river, composer)]
    handed_on = {}

    async def on_group(index, rollouts):  # the fit loop scores what it is handed
        handed_on[index] = rollouts

    batch, replica = run_agent(
        tokenizer,
        policy,
        prompts,
        [retrieval],
        fmt="hermes",
        n=2,
        code_url=dead_url(),
        tool_failure="drop_group",
        on_group=on_group,
    )
    good, failed = batch.trajectories[:2], batch.trajectories[2:]
    assert all(t.tool_turns == 1 and t.assistant_turns == 2 and not t.failed_tool for t in good)
    for trajectory, rollout in zip(failed, batch.rollouts[2:]):
        # ended on the model's call: no failure text in the context, no further turn generated
        assert (trajectory.assistant_turns, trajectory.tool_turns, trajectory.tool_errors) == (1, 0, 1)
        assert set(rollout.loss_mask.tolist()) == {1} and "Execution failed" not in tokenizer.decode(
            rollout.response_ids.tolist()
        )
    assert len(replica.requests) == 2 * 2 + 2  # two turns of each good trajectory, one of each failed one
    assert batch.failed_prompts == [1] and batch.dropped_groups == 1
    # the dropped group is never handed on to be scored; the other is, its n rollouts as in the batch
    assert list(handed_on) == [0] and handed_on[0] == batch.rollouts[:2]
    metrics = batch.metrics()
    assert metrics["tool/dropped_groups"] == 1 and metrics["tool/failed_trajectories"] == 2
    assert AgentBatch.merged([batch, batch]).metrics()["tool/dropped_groups"] == 2


def test_verl_example_search_config_runs_a_search_turn(retrieval, tokenizers):
    """verl's own examples/.../search_tool_config.yaml, unchanged, through the run's entry points
    (load_config's checks, agent_tools, chat_template_tools, build_agent)."""
    from trainer.config import load_config

    verl_file = ROOT / "tests" / "fixtures" / "verl_tools" / "search_tool_config.yaml"
    key = "actor_rollout_ref.rollout.multi_turn"
    config = load_config(
        [f"{key}.enable=true", f"{key}.tool_config_path={verl_file}", f"{key}.max_tool_response_length=2048"]
    )
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    tools = agent_tools(multi_turn, config.services)
    # the file names verl's example server on port 8000; ours listens on a free port: only the URL moves
    tools = ToolSet(tuple(dataclasses.replace(spec, urls=(retrieval,)) for spec in tools.tools))
    tokenizer, question = tokenizers["qwen"], QA_ROWS[0]["question"]
    messages = [{"role": "user", "content": f"Answer with the search tool. Question: {question}"}]
    template = chat_template_tools(multi_turn, tools)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template)
    assert "Searches the web for relevant information" in text  # the file's schema, shown to the model
    replica = ScriptedReplica(tokenizer, planned("hermes", {question: ["Norvik River"]}, {question: "Amber"}))

    async def go():
        manager = RolloutManager(ReplicaPool([replica]))
        agent = await build_agent(
            multi_turn, config.services, tools, engine=manager, tokenizer=tokenizer, max_response_length=4096
        )
        try:
            prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            return await agent.generate([prompt], SamplingParams(n=1, max_new_tokens=1))
        finally:
            await agent.aclose()
            await asyncio.to_thread(manager.close)

    batch = asyncio.run(go())
    (response,) = tool_responses(tokenizer, batch.rollouts[0])
    passages = json.loads(response)["result"]
    # verl's SearchTool defaults: topk 3 (the file sets none), passages written as verl writes them
    assert passages.startswith('Doc 1 (Title: "Norvik River")') and "Doc 3 (Title: " in passages
    assert "Doc 4" not in passages and batch.metrics()["tool/search/calls"] == 1
    answer = tokenizer.decode(batch.rollouts[0].response_ids, skip_special_tokens=True)
    assert answer.endswith("<answer> Amber </answer>")


def bwrap_missing() -> str | None:
    """Why the code-executor's sandbox cannot start here (no bubblewrap binary), else None."""
    from services.code_executor.sandbox import SandboxUnavailable, find_bwrap

    try:
        find_bwrap(None)
    except SandboxUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.skipif(bwrap_missing() is not None, reason="the code-executor needs bubblewrap (bwrap)")
def test_both_tools_on_the_real_services(retrieval, tokenizers, monkeypatch):
    """The job group's search_code_tool_config.yaml against a real retrieval-server and a real
    code-executor: one turn searches and runs code at once, the next runs a program that never ends."""
    from trainer.config import load_config

    tokenizer, question = tokenizers["qwen"], QA_ROWS[5]["question"]  # Callow, born 1617
    turns = {
        0: search_turn("hermes", "Callow composer")
        + "\n"
        + code_turn("print(1617 + 17)\n1 / 0").split("\n", 1)[1],
        # verl's SandboxFusionTool reads a call's own `timeout` too: 2 s, not the file's 10
        2: code_turn("while True:\n    pass").replace('"arguments": {', '"arguments": {"timeout": 2, '),
    }

    def policy(context: str) -> str:
        return turns.get(context.count("<tool_response>"), answer_turn("hermes", "1617"))

    with service_process("services.code_executor") as (code_url, _):
        monkeypatch.setenv("RETRIEVAL_SERVER_URL", retrieval)
        monkeypatch.setenv("CODE_EXECUTOR_URL", code_url)
        key = "actor_rollout_ref.rollout.multi_turn"
        config = load_config(
            [
                f"{key}.enable=true",
                f"{key}.tool_config_path={ROOT / 'jobgroup' / 'tools' / 'search_code_tool_config.yaml'}",
                f"{key}.max_parallel_calls=2",
                f"{key}.max_tool_response_length=2048",
            ]
        )
        multi_turn = config.actor_rollout_ref.rollout.multi_turn
        tools = agent_tools(multi_turn, config.services)
        replica = ScriptedReplica(tokenizer, policy)

        async def go():
            manager = RolloutManager(ReplicaPool([replica]))
            agent = await build_agent(
                multi_turn,
                config.services,
                tools,
                engine=manager,
                tokenizer=tokenizer,
                max_response_length=4096,
            )
            try:
                return await agent.generate(
                    [prompt_ids(tokenizer, question)], SamplingParams(n=1, max_new_tokens=1)
                )
            finally:
                await agent.aclose()
                await asyncio.to_thread(manager.close)

        batch = asyncio.run(go())
    found, ran, endless = tool_responses(tokenizer, batch.rollouts[0])
    assert json.loads(found)["result"].startswith('Doc 1 (Title: "Callow (composer)")')
    # a program that raised is a result: its output, then its traceback (verl's stdout + stderr)
    assert ran.startswith("1634\n") and "ZeroDivisionError" in ran
    assert endless.endswith("Execution stopped: time limit exceeded.")
    metrics = batch.metrics()
    assert metrics["tool/code_interpreter/calls"] == 2 and metrics["tool/errors"] == 0
    assert not batch.trajectories[0].failed_tool


@pytest.mark.parametrize("fmt", ["search_r1", "hermes"])
def test_hermes_over_prompts_teaching_search_tags_is_reported(retrieval, tokenizers, fmt, caplog):
    # the hermes parser reads <tool_call> JSON only: prompts that teach <search> tags (a QA set served
    # with the data-server's default instruction) would train without one search, and nothing said so
    tokenizer = tokenizers["qwen"]
    row = QA_ROWS[0]
    messages = [{"role": "user", "content": f"Search with <search> query </search>. {row['question']}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    answers = {row["question"]: row["golden_answers"][0]}
    with caplog.at_level("WARNING", logger="trainer"):
        run_agent(tokenizer, planned(fmt, {row["question"]: []}, answers), [prompt], [retrieval], fmt=fmt)
    warned = [r for r in caplog.records if "teach Search-R1's <search> tags" in r.getMessage()]
    assert len(warned) == (1 if fmt == "hermes" else 0)
