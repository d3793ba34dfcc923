"""The multi-turn agent loop: rollouts that call the retrieval-server's search while they generate.

formats.py  how a model asks for a search and how the result is written back, as token ids
            (Search-R1 tags, or hermes tool calls rendered by the chat template)
tools.py    the search tool's settings: verl's multi_turn.tool_config_path YAML or services.*
search.py   SearchBatcher: the queries of every trajectory waiting at a moment, in one /retrieve
loop.py     AgentLoop: one coroutine per trajectory over the rollout manager's async generate
"""

from trainer.agent.formats import HermesFormat, SearchR1Format, ToolFormat, make_format
from trainer.agent.loop import AgentBatch, AgentLoop, AgentSettings
from trainer.agent.search import SearchBatcher, SearchOutcome
from trainer.agent.tools import SearchToolSpec, load_tool_config

__all__ = [
    "AgentBatch",
    "AgentLoop",
    "AgentSettings",
    "HermesFormat",
    "SearchBatcher",
    "SearchOutcome",
    "SearchR1Format",
    "SearchToolSpec",
    "ToolFormat",
    "load_tool_config",
    "make_format",
]
