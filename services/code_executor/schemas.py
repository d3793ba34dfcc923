"""Wire contract of the code-executor (pydantic, torch-free): SandboxFusion's `/run_code`, plus a batch.

The field names, defaults and statuses are SandboxFusion's (sandbox/server/sandbox_api.py), so verl's
`sandbox_fusion` reward and its code-interpreter tool can point `sandbox_fusion_url` at
`http://<host>:8003/run_code` unchanged:

- `status`: Success (every step finished with exit code 0), Failed (a non-zero exit code, a time
  limit, an output limit), SandboxError (the sandbox itself could not run the code; `message` says why).
- `run_result.status`: Finished (the program ended, whatever its exit code), TimeLimitExceeded,
  Error (the sandbox failed; only with SandboxError).
- `return_code` is the shell's convention, as SandboxFusion's bash wrapper reports it: 128 + N for a
  program killed by signal N (137: SIGKILL, e.g. at the output limit; 153: SIGXFSZ).

Departures: `files` values must be base64 (SandboxFusion also accepts null, which it skips: here null
is refused); `fetch_files` is accepted only empty (nothing is written outside the run's memory).
"""

from __future__ import annotations

import base64
import binascii
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.common.wire import JsonInt

MAX_FILES = 64
# What `check_relative_path` and the base64 check admit, for the OpenAPI document (so a request the
# schema admits is one the server takes): a path component is anything but "", "." and "..".
PATH_PART = r"(?:[^./\x00][^/\x00]*|\.[^./\x00][^/\x00]*|\.\.[^/\x00]+)"
PATH_PATTERN = rf"^{PATH_PART}(?:/{PATH_PART})*$"
BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"


class RunStatus(str, Enum):
    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunStatus(str, Enum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class RunCodeRequest(BaseModel):
    """One program to run: SandboxFusion's RunCodeRequest."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="The program's source.")
    language: str = Field(
        "python", description="SandboxFusion's language name; GET /v1/languages lists those this server runs."
    )
    compile_timeout: float = Field(
        10,
        gt=0,
        description="SandboxFusion's limit on a compile step; accepted and unused here: the languages this "
        "server runs (python, bash) compile nothing.",
    )
    run_timeout: float = Field(10, gt=0, description="Wall-clock seconds the program may run.")
    memory_limit_MB: JsonInt = Field(
        -1, ge=-1, description="Address-space limit in MiB; -1: the server's default."
    )
    stdin: str | None = Field(None, description="Text fed to the program's standard input.")
    files: dict[str, str] = Field(
        default_factory=dict,
        description="Extra files for the run's scratch dir: relative path -> base64 content.",
        json_schema_extra={
            "maxProperties": MAX_FILES,
            "propertyNames": {"pattern": PATH_PATTERN, "maxLength": 255},
            "additionalProperties": {"type": "string", "pattern": BASE64_PATTERN},
        },
    )
    fetch_files: list[str] = Field(
        default_factory=list,
        description="Accepted only empty: output files are not sent back.",
        json_schema_extra={"maxItems": 0},
    )

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, str]) -> dict[str, str]:
        if len(files) > MAX_FILES:
            raise ValueError(f"at most {MAX_FILES} files per run, got {len(files)}")
        for path, content in files.items():
            check_relative_path(path)
            try:
                base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"{path!r}: content is not base64") from None
        return files

    @field_validator("fetch_files")
    @classmethod
    def _fetch_files(cls, fetch_files: list[str]) -> list[str]:
        if fetch_files:
            raise ValueError("this server does not send files back; send fetch_files empty")
        return fetch_files


def check_relative_path(path: str) -> None:
    """A file name inside the scratch dir: relative, no '..', no empty or odd parts."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise ValueError(f"{path[:80]!r}: file paths must be relative, without '.', '..' or empty parts")
    if len(path) > 255:
        raise ValueError(f"{path[:80]!r}...: file paths are at most 255 characters")


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = Field(None, description="Wall-clock seconds.")
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str = Field("", description="Why, for SandboxError; else empty.")
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class RunBatchRequest(BaseModel):
    """Several independent programs in one request (the trainer's reward path): run in parallel."""

    model_config = ConfigDict(extra="forbid")

    runs: list[RunCodeRequest]


class RunBatchResponse(BaseModel):
    results: list[RunCodeResponse] = Field(description="One per run, in the order sent.")


class LanguageInfo(BaseModel):
    name: str
    command: list[str] = Field(description="How a program is run inside the sandbox.")


class LanguagesResponse(BaseModel):
    languages: list[LanguageInfo]
