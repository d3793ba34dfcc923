"""The search tool's settings: from verl's multi_turn.tool_config_path YAML, or from services.*.

verl's file lists tools by class; the one this trainer runs is the search tool (verl's
`verl.tools.search_tool.SearchTool`, whose `/retrieve` protocol the retrieval-server speaks):

    tools:
      - class_name: verl.tools.search_tool.SearchTool
        config: {retrieval_service_url: http://host:8002/retrieve, topk: 3, default_timeout: 30, ...}
        tool_schema: {type: function, function: {name: search, parameters: {... query_list ...}}}

`${oc.env:VAR,default}` is resolved as verl resolves it (OmegaConf). The URL may name several
replicas, comma-separated, as RETRIEVAL_SERVER_URL does; the `/retrieve` path is optional. verl's
num_workers / rate_limit / enable_global_rate_limit size its per-call thread pool; the agent loop
batches the queries of waiting trajectories instead, so they change nothing here (the run says so once
at start, with verl's other no-effect keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainer.agent.formats import SEARCH_TOOL, SEARCH_TOOL_SCHEMA

KNOWN_CONFIG_KEYS = {"type", "retrieval_service_url", "topk", "default_timeout"}
NO_EFFECT_CONFIG_KEYS = {"num_workers", "rate_limit", "enable_global_rate_limit"}


@dataclass(frozen=True)
class SearchToolSpec:
    """Where the search goes and what the model is told about the tool."""

    urls: tuple[str, ...]  # retrieval-server base URLs (replicas)
    topk: int = 3  # passages per query
    timeout_s: float = 30.0  # per /retrieve attempt
    schema: dict = field(default_factory=lambda: SEARCH_TOOL_SCHEMA)  # for the chat template's tools=
    no_effect: tuple[str, ...] = ()  # verl's keys in the file that change nothing here

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def base_urls(value: str | list[str]) -> tuple[str, ...]:
    """'http://a:8002,http://b:8002/retrieve' (or a list) -> ('http://a:8002', 'http://b:8002')."""
    items = value.split(",") if isinstance(value, str) else list(value)
    urls = []
    for item in items:
        url = str(item).strip().rstrip("/")
        if url.endswith("/retrieve"):
            url = url[: -len("/retrieve")]
        if url:
            urls.append(url)
    if not urls:
        raise ValueError(f"no retrieval-server URL in {value!r}")
    return tuple(urls)


def load_tool_config(path: str | Path) -> SearchToolSpec:
    """The search tool of a verl tool config file; ValueError naming the problem."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"multi_turn.tool_config_path {path} is not a file")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:  # noqa: BLE001 - YAML and interpolation errors alike: name the file
        raise ValueError(f"multi_turn.tool_config_path {path}: {exc}") from exc
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{path}: expected a top-level `tools:` list")
    if len(tools) != 1 or not _is_search_tool(tools[0]):
        names = [_tool_name(t) for t in tools]
        raise ValueError(
            f"{path}: this trainer runs one tool, the search tool (verl.tools.search_tool.SearchTool); "
            f"the file lists {names}"
        )
    return _search_spec(tools[0], path)


def _tool_name(tool) -> str:
    if not isinstance(tool, dict):
        return repr(tool)
    function = (tool.get("tool_schema") or {}).get("function") or {}
    return str(function.get("name") or tool.get("class_name"))


def _is_search_tool(tool) -> bool:
    return isinstance(tool, dict) and (
        str(tool.get("class_name", "")).endswith("SearchTool") or _tool_name(tool) == SEARCH_TOOL
    )


def _search_spec(tool: dict, path: Path) -> SearchToolSpec:
    config = tool.get("config") or {}
    unknown = sorted(set(config) - KNOWN_CONFIG_KEYS - NO_EFFECT_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown search tool config keys {unknown}")
    if not config.get("retrieval_service_url"):
        raise ValueError(f"{path}: the search tool needs config.retrieval_service_url")
    schema = tool.get("tool_schema") or SEARCH_TOOL_SCHEMA
    parameters = (schema.get("function") or {}).get("parameters") or {}
    if "query_list" not in (parameters.get("properties") or {}):
        raise ValueError(f"{path}: the search tool's schema must take `query_list` (verl's SearchTool)")
    spec = SearchToolSpec(
        urls=base_urls(config["retrieval_service_url"]),
        topk=int(config.get("topk", 3)),
        timeout_s=float(config.get("default_timeout", 30)),
        schema=schema,
        no_effect=tuple(sorted(set(config) & NO_EFFECT_CONFIG_KEYS)),
    )
    if spec.topk < 1 or spec.timeout_s <= 0:
        raise ValueError(f"{path}: topk must be >= 1 and default_timeout > 0")
    return spec
