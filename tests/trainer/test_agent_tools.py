"""verl's tool config files as verl writes them, our shipped ones as verl reads them, and the code tool's
request and response handling (SandboxFusion's /run_code). The tools inside the loop, against real
services: test_agent_loop.py."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from services.common.client import ServiceError
from testing.tiny import load_tiny_tokenizer
from tests.helpers import free_port
from trainer.agent.build import agent_tools, chat_template_tools
from trainer.agent.code import CodeExecutorClient, CodeTool, run_request, run_result
from trainer.agent.tools import (
    CODE_TOOL_SCHEMA,
    SEARCH_TOOL_SCHEMA,
    CodeToolSpec,
    SearchToolSpec,
    base_urls,
    load_tool_config,
    verl_tool_schema,
)

ROOT = Path(__file__).resolve().parents[2]
VERL = ROOT / "tests" / "fixtures" / "verl_tools"
SHIPPED = ROOT / "jobgroup" / "tools"
# git blob ids of examples/sglang_multiturn/config/tool_config/* at verl b178a3cd (tests/fixtures/verl_tools)
VERL_BLOBS = {
    "geo3k_tool_config.yaml": "675a342e67cf0699d575b5a7db27c72a4c8e8f12",
    "gsm8k_tool_config.yaml": "a4197baabf08e1ac076357db8286c8641fc02f54",
    "mcp_tool_config.yaml": "40abf7c67126061db364147b4ae626574d7e0a77",
    "sandbox_fusion_tool_config.yaml": "516acf56946b8de6fa40e07cc53042e8a2fcdd18",
    "search_tool_config.yaml": "926b6b832f283175f92cc86b6cc4a1964096a8d3",
}
# What verl's classes read from `config` (verl/tools/search_tool.py SearchTool.__init__ and
# verl/tools/sandbox_fusion_tools.py SandboxFusionTool.__init__, config.get(...)), plus the loader's
# `type` (verl/tools/utils/tool_registry.py): written here from verl's source, not from tools.py.
VERL_READS = {
    "verl.tools.search_tool.SearchTool": {
        "type", "retrieval_service_url", "topk", "timeout", "num_workers", "rate_limit",
        "enable_global_rate_limit",
    },
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": {
        "type", "sandbox_fusion_url", "default_timeout", "default_language", "memory_limit_mb", "num_workers",
        "rate_limit", "enable_global_rate_limit",
    },
}  # fmt: skip


def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# ------------------------------------------------------------------------------------------ verl's files


def test_the_fixtures_are_verl_files_byte_for_byte():
    assert {p.name for p in VERL.glob("*.yaml")} == set(VERL_BLOBS)
    for name, blob in VERL_BLOBS.items():
        assert git_blob_id(VERL / name) == blob, f"{name} differs from verl's"


def test_verl_search_example_loads_as_verl_reads_it():
    (search,) = load_tool_config(VERL / "search_tool_config.yaml").tools
    # `timeout: 30` is SearchTool's own key (it was refused as unknown before); the URL's /retrieve is
    # the path the client adds
    assert search == SearchToolSpec(
        urls=("http://127.0.0.1:8000",),
        topk=3,  # SearchTool's default
        timeout_s=30.0,
        schema={
            "type": "function",
            "function": {
                "name": "search",
                "description": "Searches the web for relevant information based on the given query.",
                "parameters": {
                    "type": "object",
                    # verl's file writes `item:` (sic); verl's schema model drops it, and the model is
                    # shown what verl shows
                    "properties": {
                        "query_list": {
                            "type": "array",
                            "description": "A list of fully-formed semantic queries. The tool will return "
                            "search results for each query.",
                        }
                    },
                    "required": ["query_list"],
                },
            },
        },
        no_effect=("num_workers", "rate_limit"),
    )


def test_verl_sandbox_fusion_example_loads_as_the_code_tool():
    tools = load_tool_config(VERL / "sandbox_fusion_tool_config.yaml")
    (code,) = tools.tools
    assert isinstance(code, CodeToolSpec) and code.name == "code_interpreter"
    assert code.urls == ("https://xxx.apigateway-cn-beijing.volceapi.com",)  # /run_code: the client's path
    assert (code.timeout_s, code.language, code.memory_limit_mb) == (30.0, "python", 1024)
    assert code.schema["function"]["parameters"]["required"] == ["code"]
    assert tools.no_effect == (
        "code_interpreter.enable_global_rate_limit",
        "code_interpreter.num_workers",
        "code_interpreter.rate_limit",
    )


@pytest.mark.parametrize(
    "name, needle",
    [
        ("gsm8k_tool_config.yaml", "unknown tool class verl.tools.gsm8k_tool.Gsm8kTool; this trainer runs"),
        ("geo3k_tool_config.yaml", "unknown tool class verl.tools.geo3k_tool.Geo3kTool; this trainer runs"),
        ("mcp_tool_config.yaml", r"MCP tools \(config.type mcp, verl.tools.mcp_search_tool.MCPSearchTool\)"),
    ],
)
def test_verl_tools_this_trainer_does_not_run_are_named(name, needle):
    with pytest.raises(ValueError, match=needle) as refused:
        load_tool_config(VERL / name)
    assert "verl.tools.search_tool.SearchTool" in str(refused.value)  # and what it does run


# ------------------------------------------------------------------------------------------ ours


@pytest.mark.parametrize(
    "name", ["search_tool_config.yaml", "code_tool_config.yaml", "search_code_tool_config.yaml"]
)
def test_shipped_configs_are_ones_verl_loads(name):
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(SHIPPED / name), resolve=True)
    for entry in raw["tools"]:
        # tool_registry.py: ToolType(config.type), the class imported by name, the schema validated
        assert entry["config"]["type"] == "native" and entry["class_name"] in VERL_READS
        # every key is one the class reads (verl ignores others silently: a setting that never applies)
        assert set(entry["config"]) <= VERL_READS[entry["class_name"]], entry["class_name"]
        assert verl_tool_schema(entry["tool_schema"])["function"]["name"]
    assert load_tool_config(SHIPPED / name).tools


def test_shipped_configs_take_their_urls_from_the_job_group(monkeypatch):
    for var in ("RETRIEVAL_SERVER_URL", "CODE_EXECUTOR_URL", "RETRIEVAL_TOPK"):
        monkeypatch.delenv(var, raising=False)
    both = load_tool_config(SHIPPED / "search_code_tool_config.yaml")
    assert both.names == ("search", "code_interpreter")  # in the file's order, as the template lists them
    search, code = both.tools
    assert (search.urls, search.topk, search.timeout_s) == (("http://127.0.0.1:8002",), 3, 30.0)
    assert (code.urls, code.timeout_s, code.language) == (("http://127.0.0.1:8003",), 10.0, "python")
    # the combined file is the two single-tool files' entries, not a third variant of them
    assert both.tools == (
        *load_tool_config(SHIPPED / "search_tool_config.yaml").tools,
        *load_tool_config(SHIPPED / "code_tool_config.yaml").tools,
    )
    monkeypatch.setenv("RETRIEVAL_SERVER_URL", "http://r-0.g:8002,http://r-1.g:8002")
    monkeypatch.setenv("CODE_EXECUTOR_URL", "http://code-0.g:8003")
    monkeypatch.setenv("RETRIEVAL_TOPK", "5")
    search, code = load_tool_config(SHIPPED / "search_code_tool_config.yaml").tools
    assert search.urls == ("http://r-0.g:8002", "http://r-1.g:8002") and search.topk == 5
    assert code.urls == ("http://code-0.g:8003",)


def test_both_schemas_are_shown_by_the_chat_template():
    from trainer.config import load_config

    both = SHIPPED / "search_code_tool_config.yaml"
    on = "actor_rollout_ref.rollout.multi_turn.enable=true"
    config = load_config([on, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={both}"])
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    tools = agent_tools(multi_turn, config.services)
    kwargs = chat_template_tools(multi_turn, tools)
    assert kwargs == {"tools": tools.schemas} and len(kwargs["tools"]) == 2
    tokenizer = load_tiny_tokenizer("qwen")
    messages = [{"role": "user", "content": "What is 2**100?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    assert '"name": "search"' in prompt and '"name": "code_interpreter"' in prompt
    # search_r1's tags call the search alone: two tools need the hermes format
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="format=search_r1 calls the search tool alone"):
        load_config(
            [
                on,
                "actor_rollout_ref.rollout.multi_turn.format=search_r1",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={both}",
            ]
        )


def test_without_a_file_the_search_tool_serves_services_retrieval_url():
    from trainer.config import load_config

    config = load_config(
        ["actor_rollout_ref.rollout.multi_turn.enable=true", "services.retrieval_url=http://r:8002"]
    )
    (search,) = agent_tools(config.actor_rollout_ref.rollout.multi_turn, config.services).tools
    assert search.urls == ("http://r:8002",) and search.schema == verl_tool_schema(SEARCH_TOOL_SCHEMA)


def test_tool_failure_policy_is_a_config_key():
    from trainer.config import ConfigError, checks, load_config

    key = "actor_rollout_ref.rollout.multi_turn"
    default = load_config([])
    assert default.actor_rollout_ref.rollout.multi_turn.tool_failure == "text"  # verl's behaviour, as before
    retry = load_config([f"{key}.tool_failure=retry", f"{key}.tool_failure_retries=4"])
    assert retry.actor_rollout_ref.rollout.multi_turn.tool_failure_retries == 4
    with pytest.raises(ConfigError, match="tool_failure"):
        load_config([f"{key}.tool_failure=ignore"])
    with pytest.raises(ConfigError, match="tool_failure_retries"):
        load_config([f"{key}.tool_failure=retry", f"{key}.tool_failure_retries=0"])
    unused = load_config([f"{key}.enable=true", f"{key}.tool_failure=text", f"{key}.tool_failure_retries=5"])
    said = checks.notices(unused)
    assert any("tool_failure_retries=5 (tool_failure=text, not retry)" in line for line in said)


# ------------------------------------------------------------------------------------------ bad files

SEARCH = "verl.tools.search_tool.SearchTool"
CODE = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"


def entry(class_name: str = SEARCH, config: str = "", *, schema: str = "") -> str:
    """One tool of a file; config: the keys after `type: native` and the service URL."""
    url = "retrieval_service_url: http://h/retrieve" if class_name != CODE else "sandbox_fusion_url: http://c"
    config = (
        config
        if config.startswith("{")
        else "{type: native, " + url + (", " + config if config else "") + "}"
    )
    text = f"tools:\n  - class_name: {class_name}\n    config: {config}\n"
    return text + (f"    tool_schema: {schema}\n" if schema else "")


def second(body: str) -> str:
    """A file's tool entries without the `tools:` line, to append to another file."""
    return body.split("tools:\n", 1)[1]


NO_QUERY_LIST = "{type: function, function: {name: s, description: d, parameters: " + (
    "{type: object, properties: {q: {type: string}}, required: []}}}"
)


@pytest.mark.parametrize(
    "body, needle",
    [
        ("something: 1\n", "top-level `tools:` list"),
        ("tools: []\n", "top-level `tools:` list"),
        ("tools: [1]\n", r"tools\[0\] \(1\): a tool is a mapping"),
        ("tools:\n  - config: {type: native}\n", "class_name is missing"),
        (entry(config="{retrieval_service_url: http://h}"), r"config.type is required \(verl: native or mcp"),
        (entry(config="{type: remote}"), "config.type must be native or mcp"),
        (entry() + "    params: {}\n", r"unknown keys \['params'\]"),
        (entry("my_tools.Calculator"), "unknown tool class my_tools.Calculator"),
        (entry(config="{type: native}"), "config.retrieval_service_url is required"),
        (entry(config="default_timeout: 5"), "SearchTool reads config.timeout, not config.default_timeout"),
        (entry(CODE, "timeout: 5"), "SandboxFusionTool reads config.default_timeout, not config.timeout"),
        (entry(config="top_k: 2"), r"unknown config keys \['top_k'\]"),
        (entry(config="topk: three"), "config.topk must be a number"),
        (entry(config="topk: 0"), "config.topk must be a positive int"),
        (entry(config="topk: 2.5"), "config.topk must be a positive int"),
        (entry(config="timeout: 0"), "config.timeout must be a positive float"),
        (entry(CODE, "{type: native}"), "config.sandbox_fusion_url is required"),
        (entry(CODE, "memory_limit_mb: -1"), "memory_limit_mb must be a positive"),
        (entry(CODE, "default_language: ''"), "default_language"),
        (entry(schema="{type: function, function: {name: search}}"), r"function.description: Field required"),
        (entry(schema=NO_QUERY_LIST), "must take `query_list`"),
        (entry(CODE, schema="{type: function, function: {name: c, description: d}}"), "must take `code`"),
        (entry() + second(entry()), r"two tools are named \['search'\]"),
        ("tools: [\n", "multi_turn.tool_config_path .*tools.yaml"),
        (entry(config="{type: native, retrieval_service_url: '${oc.env:NO_SUCH_VAR_4}'}"), "NO_SUCH_VAR_4"),
    ],
)
def test_bad_tool_configs_are_refused_with_the_reason(tmp_path, body, needle):
    path = tmp_path / "tools.yaml"
    path.write_text(body)
    with pytest.raises(ValueError, match=needle):
        load_tool_config(path)


def test_a_missing_file_and_an_optional_schema(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        load_tool_config(tmp_path / "missing.yaml")
    path = tmp_path / "tools.yaml"
    path.write_text(
        entry() + entry(CODE, "{type: native, sandbox_fusion_url: http://c/run_code}").split("tools:\n", 1)[1]
    )
    search, code = load_tool_config(path).tools  # no tool_schema: the class's documented one
    assert search.schema == verl_tool_schema(SEARCH_TOOL_SCHEMA)
    assert code.schema == verl_tool_schema(CODE_TOOL_SCHEMA) and code.urls == ("http://c",)


def test_base_urls_accept_replicas_and_the_service_path():
    assert base_urls("http://a:1/retrieve") == ("http://a:1",)
    assert base_urls(" http://a:1/ , http://b:2/retrieve") == ("http://a:1", "http://b:2")
    assert base_urls("http://c:3/run_code", "/run_code") == ("http://c:3",)
    with pytest.raises(ValueError):
        base_urls(" , ")


# ------------------------------------------------------------------------------------------ code tool

SPEC = CodeToolSpec(urls=("http://127.0.0.1:1",), timeout_s=10.0, language="python", memory_limit_mb=512)


def test_a_call_becomes_a_sandbox_fusion_run_code_request():
    request, problem = run_request({"code": "print(1)"}, SPEC)
    assert problem is None and request == {
        "code": "print(1)",
        "language": "python",
        "compile_timeout": 10.0,
        "run_timeout": 10.0,
        "memory_limit_MB": 512,
        "stdin": None,
        "files": {},
    }
    # verl's SandboxFusionTool also reads `language` and `timeout` from the call; a call may only shorten
    # the run (10 s is the config's default_timeout)
    request, _ = run_request({"code": "x", "language": "bash", "timeout": 3}, SPEC)
    assert (request["language"], request["run_timeout"]) == ("bash", 3.0)
    assert run_request({"code": "x", "timeout": 600}, SPEC)[0]["run_timeout"] == 10.0


@pytest.mark.parametrize(
    "arguments, needle",
    [
        ({}, "'code' is missing"),
        ({"code": "  "}, "'code' is missing"),
        ({"code": 12}, "'code' is missing"),
        ({"code": "x", "timeout": -1}, "'timeout' must be a positive"),
        ({"code": "x", "timeout": True}, "'timeout' must be a positive"),
        ({"code": "x", "language": ""}, "'language' must be"),
    ],
)
def test_calls_the_code_tool_cannot_run_are_told_why(arguments, needle):
    request, problem = run_request(arguments, SPEC)
    assert request is None and needle in problem


def finished(stdout: str, stderr: str = "", return_code: int = 0, status: str = "Finished") -> dict:
    run = {
        "status": status,
        "execution_time": 0.1,
        "return_code": return_code,
        "stdout": stdout,
        "stderr": stderr,
    }
    overall = "Success" if status == "Finished" and return_code == 0 else "Failed"
    return {"status": overall, "compile_result": None, "run_result": run, "files": {}}


def test_run_results_are_what_the_program_printed():
    # verl's text for a finished run: stdout then stderr, with any exit code
    assert run_result(finished("42\n")).text == "42\n"
    assert run_result(finished("42\n")).status == "ok"
    traceback = "Traceback (most recent call last):\nZeroDivisionError: division by zero\n"
    raised = run_result(finished("before\n", traceback, return_code=1))
    assert raised.status == "ok" and raised.text == "before\n" + traceback  # a traceback is a result
    assert run_result(finished("")).text == ""
    # a run that did not finish keeps what it printed and says what ended it (verl: "no stdout here")
    slow = run_result(finished("tick\ntick", status="TimeLimitExceeded", return_code=-9))
    assert slow.status == "ok" and slow.text == "tick\ntick\nExecution stopped: time limit exceeded."
    killed = run_result(finished("", status="Error", return_code=137))
    assert killed.text == "Execution stopped: Error, return code 137."
    compile_error = {
        "status": "Failed",
        "compile_result": {
            "status": "Finished",
            "return_code": 1,
            "stdout": "",
            "stderr": "a.cpp:1: error\n",
        },
        "run_result": None,
    }
    assert run_result(compile_error).text == "a.cpp:1: error\nCompilation stopped: exit code 1."


@pytest.mark.parametrize(
    "response",
    [
        {"status": "SandboxError", "message": "worker pool exhausted", "run_result": None},
        {"status": "Success", "compile_result": None},  # no run_result at all
        {"status": "Exploded"},
    ],
)
def test_sandbox_errors_are_tool_failures(response):
    result = run_result(response)
    assert result.status == "failed" and result.text.startswith("Execution failed:") and result.error


def test_a_code_executor_that_never_answers_is_a_tool_failure():
    """A real client against a loopback port nobody listens on: refused, retried, then a failed result
    (never an exception into the rollout)."""

    async def go():
        spec = CodeToolSpec(urls=(f"http://127.0.0.1:{free_port()}",))
        tool = CodeTool(CodeExecutorClient(list(spec.urls), retries=1, backoff_s=0.01, timeout_s=2), spec)
        try:
            result = await tool.call({"code": "print(1)"})
            with pytest.raises(ServiceError):
                await tool.wait_healthy(0.2)
            return result
        finally:
            await tool.aclose()

    result = asyncio.run(go())
    assert result.status == "failed" and result.text == "Execution failed: the code-executor did not answer"
    assert "gave up after 2 attempts" in result.error


@pytest.mark.parametrize("tool_kind", ["search", "code"])
def test_a_tool_whose_service_stays_down_fails_at_services_retry_deadline_s(tool_kind):
    """The run's tool clients (tool_runner) keep trying a service that refuses connections until
    services.retry_deadline_s after the first failure, as the data and reward clients do, then the call
    is a failed result. retries=0: the deadline alone keeps them trying (before, they gave up at once)."""
    import time

    from trainer.agent.build import tool_runner
    from trainer.config.run import ServicesConfig

    deadline_s = 3.0
    services = ServicesConfig(retries=0, retry_deadline_s=deadline_s)
    urls = (f"http://127.0.0.1:{free_port()}",)  # nobody listens
    spec = SearchToolSpec(urls=urls) if tool_kind == "search" else CodeToolSpec(urls=urls)
    arguments = {"query_list": ["anything"]} if tool_kind == "search" else {"code": "print(1)"}

    async def go():
        tool = tool_runner(spec, "hermes", services)
        try:
            started = time.monotonic()
            result = await tool.call(arguments)
            waited = time.monotonic() - started
            errors = tool.batcher.take_stats().errors if tool_kind == "search" else [result.error]
            return result, waited, errors
        finally:
            await tool.aclose()

    result, waited, (error,) = asyncio.run(go())
    assert result.status == "failed"
    # tries every 2.5-5 s after the first refusal, the last one at the deadline (then none is left)
    assert deadline_s - 0.1 <= waited < deadline_s + 2.0
    assert "gave up after" in error and f"over {deadline_s:.0f} s" in error
