"""The agent loop a run uses, built once from the config (trainer/build.py calls this when
actor_rollout_ref.rollout.multi_turn.enable is set)."""

from __future__ import annotations

from services.retrieval_server.client import RetrievalClient
from trainer.agent.formats import make_format
from trainer.agent.loop import AgentLoop, AgentSettings, TurnEngine
from trainer.agent.search import SearchBatcher
from trainer.agent.tools import SearchToolSpec, load_tool_config


def search_tool_spec(multi_turn, services) -> SearchToolSpec:
    """The tool config file's search tool, else services.retrieval_url with verl's SearchTool schema."""
    if multi_turn.tool_config_path:
        return load_tool_config(multi_turn.tool_config_path)
    return SearchToolSpec(urls=tuple(services.retrieval_url), timeout_s=services.timeout_s)


def chat_template_tools(multi_turn, spec: SearchToolSpec) -> dict:
    """apply_chat_template kwargs that show the tool to the model: its schema, in the hermes format."""
    return {"tools": [spec.schema]} if multi_turn.format == "hermes" else {}


async def build_agent(
    multi_turn, services, spec: SearchToolSpec, *, engine: TurnEngine, tokenizer, max_response_length: int
) -> AgentLoop:
    """The loop over `engine`, its retrieval-server already healthy (ServiceError if it never is)."""
    client = RetrievalClient(
        list(spec.urls), timeout_s=spec.timeout_s, retries=services.retries, token=services.auth_token
    )
    try:
        await client.wait_healthy(services.health_timeout_s)
        tool_format = make_format(
            multi_turn.format,
            tokenizer,
            max_parallel_calls=multi_turn.max_parallel_calls,
            tool_names=(spec.name,),
        )
    except BaseException:
        await client.aclose()
        raise
    settings = AgentSettings(
        max_response_length=max_response_length,
        max_assistant_turns=multi_turn.max_assistant_turns,
        max_user_turns=multi_turn.max_user_turns,
        max_parallel_calls=multi_turn.max_parallel_calls,
        max_tool_response_length=multi_turn.max_tool_response_length,
        tool_response_truncate_side=multi_turn.tool_response_truncate_side,
    )
    searcher = SearchBatcher(client, topk=spec.topk, max_requests=len(spec.urls))
    return AgentLoop(engine, tokenizer, tool_format, searcher, settings)
