"""The agent loop a run uses, built once from the config (trainer/build.py calls this when
actor_rollout_ref.rollout.multi_turn.enable is set):

    tools = agent_tools(multi_turn, services)                     # the tool config file, checked
    kwargs = chat_template_tools(multi_turn, tools)               # the schemas the prompt shows
    agent = await build_agent(multi_turn, services, tools, engine=..., tokenizer=..., ...)
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from services.retrieval_server.client import RetrievalClient
from trainer.agent.code import CodeExecutorClient, CodeTool
from trainer.agent.formats import make_format
from trainer.agent.loop import AgentLoop, AgentSettings, TurnEngine
from trainer.agent.search import SearchBatcher, SearchTool
from trainer.agent.tools import CodeToolSpec, SearchToolSpec, ToolSet, load_tool_config

# A code run's HTTP request waits for the run (compile and run limits) plus this much queueing.
RUN_REQUEST_SLACK_S = 30.0


def agent_tools(multi_turn, services) -> ToolSet:
    """The tools of multi_turn.tool_config_path, else the search tool at services.retrieval_url with
    verl's SearchTool schema."""
    if multi_turn.tool_config_path:
        return load_tool_config(multi_turn.tool_config_path)
    return ToolSet((SearchToolSpec(urls=tuple(services.retrieval_url), timeout_s=services.timeout_s),))


def chat_template_tools(multi_turn, tools: ToolSet) -> dict:
    """apply_chat_template kwargs that show the tools to the model: their schemas, in the hermes format
    (verl passes the same list as `tools=`)."""
    return {"tools": tools.schemas} if multi_turn.format == "hermes" else {}


def agent_settings(multi_turn, max_response_length: int) -> AgentSettings:
    return AgentSettings(
        max_response_length=max_response_length,
        max_assistant_turns=multi_turn.max_assistant_turns,
        max_user_turns=multi_turn.max_user_turns,
        max_parallel_calls=multi_turn.max_parallel_calls,
        max_tool_response_length=multi_turn.max_tool_response_length,
        tool_response_truncate_side=multi_turn.tool_response_truncate_side,
        tool_failure=multi_turn.tool_failure,
        tool_failure_retries=multi_turn.tool_failure_retries,
    )


async def build_agent(
    multi_turn,
    services,
    tools: ToolSet,
    *,
    engine: TurnEngine,
    tokenizer,
    max_response_length: int,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> AgentLoop:
    """The loop over `engine`, every tool's service already healthy (ServiceError if one never is).
    chat_template, template_kwargs: those the prompts are rendered with (the hermes format's turns too)."""
    async with AsyncExitStack() as cleanup:  # closes the clients made so far if a later step fails
        runners = []
        for spec in tools.tools:
            tool = tool_runner(spec, multi_turn.format, services)
            cleanup.push_async_callback(tool.aclose)
            runners.append(tool)
        for tool in runners:
            await tool.wait_healthy(services.health_timeout_s)
        tool_format = make_format(
            multi_turn.format,
            tokenizer,
            max_parallel_calls=multi_turn.max_parallel_calls,
            tool_names=tools.names,
            chat_template=chat_template,
            template_kwargs=template_kwargs,
        )
        loop = AgentLoop(
            engine, tokenizer, tool_format, runners, agent_settings(multi_turn, max_response_length)
        )
        cleanup.pop_all()  # built: the loop owns the clients now
    return loop


def tool_runner(spec: SearchToolSpec | CodeToolSpec, style, services) -> SearchTool | CodeTool:
    """The tool of one spec, with its client (the services' retries, deadline and auth token).

    services.retry_deadline_s holds as for the data and reward clients: a tool's service that its job
    group restarts is waited for (the calls in flight wait), and only after the deadline does a call
    fail (then the loop's tool-failure policy applies)."""
    if isinstance(spec, SearchToolSpec):
        client = RetrievalClient(
            list(spec.urls),
            timeout_s=spec.timeout_s,
            retries=services.retries,
            deadline_s=services.retry_deadline_s,
            token=services.auth_token,
        )
        return SearchTool(
            SearchBatcher(client, topk=spec.topk, max_requests=len(spec.urls)), spec.schema, style=style
        )
    client = CodeExecutorClient(
        list(spec.urls),
        timeout_s=2 * spec.timeout_s + RUN_REQUEST_SLACK_S,
        retries=services.retries,
        deadline_s=services.retry_deadline_s,
        token=services.auth_token,
    )
    return CodeTool(client, spec)
