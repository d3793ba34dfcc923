"""The agent's tools, read from verl's multi_turn.tool_config_path YAML (or services.* for search alone).

verl's file is a list of tools, each a class, its settings and the schema shown to the model:

    tools:
      - class_name: verl.tools.search_tool.SearchTool
        config: {type: native, retrieval_service_url: http://host:8002/retrieve, topk: 3, timeout: 30}
        tool_schema: {type: function, function: {name: search, parameters: {... query_list ...}}}
      - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
        config: {type: native, sandbox_fusion_url: http://host:8003/run_code, default_timeout: 30, ...}
        tool_schema: {type: function, function: {name: code_interpreter, parameters: {... code ...}}}

This trainer runs those two classes: the search tool against the retrieval-server (the `/retrieve`
protocol of verl's SearchTool) and the code interpreter against the code-executor (SandboxFusion's
`/run_code`). A file loads here as verl's `initialize_tools_from_config` loads it:

- `config.type` is required (`native`; verl's `mcp` tools need an MCP client, not run here);
- each class reads the keys verl's class reads: SearchTool `timeout` (not `default_timeout`, which
  verl's SearchTool ignores), SandboxFusionTool `default_timeout` (not `timeout`). A key the class
  does not read is refused with the reason, where verl would silently ignore it;
- `tool_schema` is checked against verl's OpenAIFunctionToolSchema, and the model is shown what verl
  shows it: that model's dump (fields verl's model lacks, such as `items` of an array, are dropped),
  so the prompt is the same under both trainers. Without `tool_schema` the class's documented
  schema is used (verl's two classes fail without one);
- `${oc.env:VAR,default}` is resolved as verl resolves it (OmegaConf).

The URL may name several replicas, comma-separated, as RETRIEVAL_SERVER_URL does; the path
(`/retrieve`, `/run_code`) is optional. verl's num_workers / rate_limit / enable_global_rate_limit size
its per-call thread pools; the agent loop batches searches and sends runs concurrently itself, so they
change nothing here (the run says so once at start).

Nothing here imports torch: the config checks read these files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

SEARCH_TOOL_CLASS = "verl.tools.search_tool.SearchTool"
CODE_TOOL_CLASS = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
TOOL_CLASSES = (SEARCH_TOOL_CLASS, CODE_TOOL_CLASS)

# verl's thread-pool keys: accepted, no effect here (the loop batches and runs concurrently itself)
NO_EFFECT_CONFIG_KEYS = frozenset({"num_workers", "rate_limit", "enable_global_rate_limit"})
SEARCH_CONFIG_KEYS = frozenset({"type", "retrieval_service_url", "topk", "timeout"})
CODE_CONFIG_KEYS = frozenset(
    {"type", "sandbox_fusion_url", "default_timeout", "default_language", "memory_limit_mb"}
)
# A key the other class reads, written in the wrong tool: verl ignores it, so the value never applies.
MISPLACED_KEYS = {
    SEARCH_TOOL_CLASS: {"default_timeout": "timeout"},
    CODE_TOOL_CLASS: {"timeout": "default_timeout"},
}

# The schemas verl's two classes document; the chat template shows them to the model (hermes).
SEARCH_TOOL_SCHEMA: dict = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches Wikipedia for passages relevant to each query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "A list of fully-formed semantic queries. The tool returns passages for "
                    "each query.",
                }
            },
            "required": ["query_list"],
        },
    },
}
CODE_TOOL_SCHEMA: dict = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Runs Python code in a sandbox and returns what it printed (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to run."}},
            "required": ["code"],
        },
    },
}


# ------------------------------------------------------------------------------------------ schema


class _Property(BaseModel):
    """verl.tools.schemas.OpenAIFunctionPropertySchema's fields (others are dropped, as verl drops them)."""

    type: str
    description: str | None = None
    enum: list[str] | None = None


class _Parameters(BaseModel):
    type: str
    properties: dict[str, _Property]
    required: list[str]


class _Function(BaseModel):
    name: str
    description: str
    parameters: _Parameters = _Parameters(type="object", properties={}, required=[])
    strict: bool = False


class _ToolSchema(BaseModel):
    type: str
    function: _Function


def verl_tool_schema(raw: Any) -> dict:
    """The schema as verl validates it and shows it to the model; ValueError naming the bad field."""
    try:
        schema = _ToolSchema.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'tool_schema'}: {error['msg']}"
            for error in exc.errors()
        )
        message = f"tool_schema is not an OpenAI function schema as verl reads it ({problems})"
        raise ValueError(message) from None
    return schema.model_dump(exclude_unset=True, exclude_none=True)


def schema_takes(schema: dict, argument: str) -> bool:
    parameters = schema["function"].get("parameters") or {}
    return argument in (parameters.get("properties") or {})


# ------------------------------------------------------------------------------------------ specs


@dataclass(frozen=True)
class SearchToolSpec:
    """verl's SearchTool: where the search goes and what the model is told about the tool."""

    urls: tuple[str, ...]  # retrieval-server base URLs (replicas)
    topk: int = 3  # passages per query
    timeout_s: float = 30.0  # per /retrieve attempt (verl's `timeout`)
    schema: dict = field(default_factory=lambda: verl_tool_schema(SEARCH_TOOL_SCHEMA))
    no_effect: tuple[str, ...] = ()  # verl's keys in the file that change nothing here

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


@dataclass(frozen=True)
class CodeToolSpec:
    """verl's SandboxFusionTool: the code-executor (SandboxFusion's /run_code) and the run's limits."""

    urls: tuple[str, ...]  # code-executor base URLs (replicas)
    timeout_s: float = 30.0  # run time limit of one call (verl's `default_timeout`; compile the same)
    language: str = "python"  # verl's `default_language`; a call may name another
    memory_limit_mb: int = 1024  # memory of one run (SandboxFusion's memory_limit_MB)
    schema: dict = field(default_factory=lambda: verl_tool_schema(CODE_TOOL_SCHEMA))
    no_effect: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


ToolSpec = SearchToolSpec | CodeToolSpec


@dataclass(frozen=True)
class ToolSet:
    """The tools of one run, in the file's order (the order the chat template lists them)."""

    tools: tuple[ToolSpec, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool.name for tool in self.tools)

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools]

    @property
    def no_effect(self) -> tuple[str, ...]:
        """`tool_name.key` of each verl key that changes nothing here."""
        return tuple(f"{tool.name}.{key}" for tool in self.tools for key in tool.no_effect)

    @property
    def search(self) -> SearchToolSpec | None:
        return next((tool for tool in self.tools if isinstance(tool, SearchToolSpec)), None)


def base_urls(value: str | list[str], path: str = "/retrieve") -> tuple[str, ...]:
    """'http://a:8002,http://b:8002/retrieve' (or a list) -> ('http://a:8002', 'http://b:8002')."""
    items = value.split(",") if isinstance(value, str) else list(value)
    urls = []
    for item in items:
        url = str(item).strip().rstrip("/")
        if url.endswith(path):
            url = url[: -len(path)]
        if url:
            urls.append(url)
    if not urls:
        raise ValueError(f"no service URL in {value!r}")
    return tuple(urls)


# ------------------------------------------------------------------------------------------ the file


def load_tool_config(path: str | Path) -> ToolSet:
    """The tools of a verl tool config file; ValueError naming the file, the tool and the problem."""
    path = Path(path)
    data = _read(path)
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{path}: expected a top-level `tools:` list with at least one tool")
    specs = []
    for index, entry in enumerate(tools):
        try:
            specs.append(tool_spec(entry))
        except ValueError as exc:
            raise ValueError(f"{path}: tools[{index}] ({_label(entry)}): {exc}") from None
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{path}: two tools are named {duplicates} (the model calls a tool by its name)")
    return ToolSet(tuple(specs))


def _read(path: Path) -> Any:
    from omegaconf import OmegaConf

    if not path.is_file():
        raise ValueError(f"multi_turn.tool_config_path {path} is not a file")
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:  # noqa: BLE001 - YAML and interpolation errors alike: name the file
        raise ValueError(f"multi_turn.tool_config_path {path}: {exc}") from exc


def _label(entry: Any) -> str:
    return str(entry.get("class_name")) if isinstance(entry, dict) else repr(entry)[:80]


def tool_spec(entry: Any) -> ToolSpec:
    """One entry of the `tools:` list, checked as verl's loader and the tool's class read it."""
    if not isinstance(entry, dict):
        raise ValueError("a tool is a mapping with class_name, config and tool_schema")
    unknown = sorted(set(entry) - {"class_name", "config", "tool_schema", "mcp"})
    if unknown:
        raise ValueError(f"unknown keys {unknown} (a tool has class_name, config, tool_schema)")
    class_name, config = entry.get("class_name"), entry.get("config")
    if not isinstance(class_name, str) or not class_name:
        raise ValueError("class_name is missing")
    if not isinstance(config, dict) or "type" not in config:
        raise ValueError("config.type is required (verl: native or mcp)")
    if config["type"] not in ("native", "mcp"):
        raise ValueError(f"config.type must be native or mcp (verl's ToolType), not {config['type']!r}")
    runs = f"this trainer runs {SEARCH_TOOL_CLASS} and {CODE_TOOL_CLASS}"
    if config["type"] == "mcp":
        raise ValueError(f"MCP tools (config.type mcp, {class_name}) need an MCP client; {runs}")
    if class_name not in TOOL_CLASSES:
        raise ValueError(f"unknown tool class {class_name}; {runs}")
    raw_schema = entry.get("tool_schema")
    _check_keys(class_name, config)
    if class_name == SEARCH_TOOL_CLASS:
        schema = verl_tool_schema(SEARCH_TOOL_SCHEMA if raw_schema is None else raw_schema)
        return _search_spec(config, schema)
    schema = verl_tool_schema(CODE_TOOL_SCHEMA if raw_schema is None else raw_schema)
    return _code_spec(config, schema)


def _check_keys(class_name: str, config: dict) -> None:
    known = SEARCH_CONFIG_KEYS if class_name == SEARCH_TOOL_CLASS else CODE_CONFIG_KEYS
    for key, right in MISPLACED_KEYS[class_name].items():
        if key in config:
            short = class_name.rsplit(".", 1)[1]
            raise ValueError(f"verl's {short} reads config.{right}, not config.{key} (verl would ignore it)")
    unknown = sorted(set(config) - known - NO_EFFECT_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; {class_name} reads {sorted(known)}")


def _number(config: dict, key: str, default: float, kind: type = float) -> Any:
    value = config.get(key, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"config.{key} must be a number, not {value!r}") from None
    if isinstance(value, bool) or number <= 0 or (kind is int and number != float(value)):
        raise ValueError(f"config.{key} must be a positive {kind.__name__}, not {value!r}")
    return number


def _url(config: dict, key: str, path: str) -> tuple[str, ...]:
    value = config.get(key)
    if not value or not isinstance(value, str | list):
        raise ValueError(f"config.{key} is required (the service's URL)")
    return base_urls(value, path)


def _search_spec(config: dict, schema: dict) -> SearchToolSpec:
    if not schema_takes(schema, "query_list"):
        raise ValueError("the search tool's schema must take `query_list` (verl's SearchTool reads it)")
    return SearchToolSpec(
        urls=_url(config, "retrieval_service_url", "/retrieve"),
        topk=_number(config, "topk", 3, int),
        timeout_s=_number(config, "timeout", 30),
        schema=schema,
        no_effect=tuple(sorted(set(config) & NO_EFFECT_CONFIG_KEYS)),
    )


def _code_spec(config: dict, schema: dict) -> CodeToolSpec:
    if not schema_takes(schema, "code"):
        raise ValueError("the code tool's schema must take `code` (verl's SandboxFusionTool reads it)")
    language = config.get("default_language", "python")
    if not isinstance(language, str) or not language:
        raise ValueError(f"config.default_language must be a language name, not {language!r}")
    return CodeToolSpec(
        urls=_url(config, "sandbox_fusion_url", "/run_code"),
        timeout_s=_number(config, "default_timeout", 30),
        language=language,
        memory_limit_mb=_number(config, "memory_limit_mb", 1024, int),
        schema=schema,
        no_effect=tuple(sorted(set(config) & NO_EFFECT_CONFIG_KEYS)),
    )
