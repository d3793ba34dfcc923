"""The code interpreter: verl's SandboxFusionTool against the code-executor (SandboxFusion's API).

A call `{"code": "...", "language"?: "...", "timeout"?: s}` (verl's SandboxFusionTool reads the same
arguments) becomes one `POST /run_code`:

    {code, language, compile_timeout, run_timeout, memory_limit_MB, stdin: null, files: {}}
    -> {status: Success | Failed | SandboxError, compile_result, run_result: {status: Finished |
        TimeLimitExceeded | Error, execution_time, return_code, stdout, stderr}, files}

and the model reads what the program printed: stdout then stderr, as verl's tool writes it, for a run
that finished (with any exit code: a traceback is a result the model learns from). A run that did
not finish, or a program that did not compile, is a result too; a SandboxError, or a service that
stays down after the client's retries, is a tool failure (the loop's tool-failure policy applies).

Departures from verl's SandboxFusionTool, each on purpose:
- verl answers "no stdout here" to every run that did not finish and to a dead service alike; here a
  time-out or a crash keeps the output it printed and says what ended it, and a dead service is a
  failure the loop counts (and drops or retries, if so configured), not text the model trains on.
- a call's own `timeout` may shorten the run, never lengthen it past the config's default_timeout.
- a language the service refuses (its 4xx) is the model's mistake: an invalid call, its message shown.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from services.common.client import ServiceClient, ServiceError
from trainer.agent.formats import ToolResult
from trainer.agent.tools import CodeToolSpec

log = logging.getLogger("trainer.agent")


class CodeExecutorClient(ServiceClient):
    """The code-executor's /run_code, with the services' retries and replica spreading."""

    async def run_code(self, request: Mapping[str, Any]) -> dict:
        result = await self.http.post("/run_code", dict(request))
        if not isinstance(result, dict):
            raise ValueError(f"/run_code answered {type(result).__name__}, not an object")
        return result


def run_request(arguments: Mapping[str, Any], spec: CodeToolSpec) -> tuple[dict | None, str | None]:
    """A call's arguments -> (the /run_code body, None) or (None, the problem told to the model)."""
    code = arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        return None, "Error: 'code' is missing or empty; pass the program as a string."
    language = arguments.get("language", spec.language)
    if not isinstance(language, str) or not language:
        return None, "Error: 'language' must be a language name such as 'python'."
    timeout = arguments.get("timeout", spec.timeout_s)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        return None, "Error: 'timeout' must be a positive number of seconds."
    timeout = min(float(timeout), spec.timeout_s)
    request = {
        "code": code,
        "language": language,
        "compile_timeout": timeout,
        "run_timeout": timeout,
        "memory_limit_MB": spec.memory_limit_mb,
        "stdin": None,
        "files": {},
    }
    return request, None


def run_result(response: Mapping[str, Any]) -> ToolResult:
    """A /run_code answer -> what the model reads (verl's stdout + stderr), or the tool's failure."""
    status = response.get("status")
    if status == "SandboxError" or status not in ("Success", "Failed"):
        problem = str(response.get("message") or f"the sandbox answered status {status!r}")[:300]
        return ToolResult(f"Execution failed: {problem}", "failed", problem)
    compiled = response.get("compile_result") or {}
    if compiled and (compiled.get("status") != "Finished" or compiled.get("return_code") not in (0, None)):
        return ToolResult(_output(compiled) + _ending("Compilation", compiled))
    run = response.get("run_result")
    if not isinstance(run, Mapping):
        return ToolResult("Execution failed: the sandbox returned no run result", "failed", "no run_result")
    if run.get("status") == "Finished":
        return ToolResult(_output(run))  # verl's text: stdout, then stderr, whatever the exit code
    return ToolResult(_output(run) + _ending("Execution", run))


def _output(result: Mapping[str, Any]) -> str:
    return str(result.get("stdout") or "") + str(result.get("stderr") or "")


def _ending(stage: str, result: Mapping[str, Any]) -> str:
    """Why a stage did not finish, on a line of its own after what it printed."""
    status = result.get("status")
    if status == "TimeLimitExceeded":
        reason = "time limit exceeded"
    elif status == "Finished":
        reason = f"exit code {result.get('return_code')}"
    else:
        reason = f"{status or 'error'}, return code {result.get('return_code')}"
    text = _output(result)
    return ("\n" if text and not text.endswith("\n") else "") + f"{stage} stopped: {reason}."


class CodeTool:
    """verl's SandboxFusionTool: one call runs one program on the code-executor."""

    def __init__(self, client: CodeExecutorClient, spec: CodeToolSpec) -> None:
        self.client = client
        self.spec = spec
        self.schema = spec.schema
        self.name: str = spec.name

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        request, problem = run_request(arguments, self.spec)
        if request is None:
            return ToolResult.invalid(problem or "Error: bad arguments.")
        try:
            response = await self.client.run_code(request)
        except ServiceError as exc:
            # 401/403 refuse the run's token, not the model's call: a tool failure (tool/errors, and the
            # tool_failure policy), not an invalid call, which no metric or policy treats as an outage
            refused = exc.status_code is not None and 400 <= exc.status_code < 500
            if refused and exc.status_code not in (401, 403):
                return ToolResult.invalid(f"Error: the code-executor refused the run: {_short(exc)}")
            return self._failed(exc)
        except ValueError as exc:  # an answer that is not SandboxFusion's JSON
            return self._failed(exc)
        return run_result(response)

    async def wait_healthy(self, timeout_s: float) -> None:
        await self.client.wait_healthy(timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()

    def _failed(self, exc: Exception) -> ToolResult:
        log.warning(f"code run failed: {exc}")
        problem = "the code-executor did not answer" if "gave up after" in str(exc) else _short(exc)
        return ToolResult(f"Execution failed: {problem}", "failed", str(exc)[:500])


def _short(exc: BaseException) -> str:
    """The error in one line the model can read: no URLs, no tracebacks."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"^.*?HTTP \d+: ", "", text)[:200]
