"""The code-executor's logic between the wire and the sandbox: requests -> jobs -> runs -> responses.

`Executor` is built once at startup (`build_executor`, which also proves that the sandbox works
here, its seccomp filter included, or raises SandboxUnavailable saying why: there is no unsandboxed
fallback). Limits a request may not exceed are checked here, as `LimitError`s naming the field, which
the routes turn into 422s.
"""

from __future__ import annotations

import asyncio
import base64
import math
import os
import shutil
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from services.code_executor.pool import SlotPool
from services.code_executor.sandbox import (
    Job,
    Language,
    Limits,
    Outcome,
    Sandbox,
    SandboxUnavailable,
    become_subreaper,
    find_bwrap,
    find_python,
    interpreter_prefix,
    run_job,
    system_binds,
)
from services.code_executor.schemas import (
    CommandRunResult,
    CommandRunStatus,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
)
from services.code_executor.seccomp import syscall_filter

MIB = 1024 * 1024
# long enough for the usage guard to sample it (the probe proves that /proc of a run is readable here),
# and a memfd_create that the seccomp filter must refuse (it proves that the filter is in force)
PROBE_CODE = b"""import os, time
try:
    os.memfd_create("probe")
    print("memfd_create allowed")
except PermissionError:
    print("memfd_create refused")
time.sleep(0.1)
"""
PROBE_REFUSED = b"memfd_create refused\n"


class LimitError(ValueError):
    """A request asks for more than this server allows; `field` names what to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Policy:
    """The server's limits for one run (from its settings)."""

    max_run_timeout_s: float
    default_memory_mb: int
    max_memory_mb: int
    max_processes: int
    max_file_mb: int
    scratch_mb: int
    max_output_bytes: int


def languages_here(python: str) -> dict[str, Language]:
    """SandboxFusion's language names this host can run: python always; bash where it is installed."""
    found = {"python": Language("python", "main.py", (python, "{source}"))}
    bash = shutil.which("bash", path="/usr/bin:/bin")
    if bash:
        found["bash"] = Language("bash", "main.sh", (bash, "{source}"))
    return found


def limits_for(request: RunCodeRequest, policy: Policy) -> Limits:
    run_timeout = request.run_timeout
    if "run_timeout" not in request.model_fields_set:  # SandboxFusion's default, or this server's limit
        run_timeout = min(run_timeout, policy.max_run_timeout_s)
    if run_timeout > policy.max_run_timeout_s:
        raise LimitError(
            "run_timeout",
            f"{run_timeout:g} s is above this server's limit of {policy.max_run_timeout_s:g} s",
        )
    memory_mb = policy.default_memory_mb if request.memory_limit_MB == -1 else request.memory_limit_MB
    if memory_mb > policy.max_memory_mb or memory_mb < 16:
        raise LimitError(
            "memory_limit_MB",
            f"{memory_mb} MiB is outside this server's range "
            f"16..{policy.max_memory_mb} (or -1 for its default)",
        )
    return Limits(
        wall_s=run_timeout,
        cpu_s=math.ceil(run_timeout) + 1,  # RLIMIT_CPU is whole seconds; the wall clock rules
        memory_bytes=memory_mb * MIB,
        processes=policy.max_processes,
        file_bytes=policy.max_file_mb * MIB,
        scratch_bytes=policy.scratch_mb * MIB,
        output_bytes=policy.max_output_bytes,
    )


def command_result(outcome: Outcome) -> CommandRunResult:
    return CommandRunResult(
        status=outcome.status,
        execution_time=round(outcome.execution_time, 6),
        return_code=outcome.return_code,
        stdout=outcome.stdout.decode(errors="replace"),
        stderr=outcome.stderr.decode(errors="replace") if outcome.error is None else outcome.error,
    )


def response_for(outcome: Outcome) -> RunCodeResponse:
    """SandboxFusion's verdict: an Error step is a SandboxError, a time limit or a non-zero exit Failed."""
    result = command_result(outcome)
    if outcome.status == CommandRunStatus.Error:
        return RunCodeResponse(status=RunStatus.SandboxError, message=outcome.error or "", run_result=result)
    failed = outcome.status == CommandRunStatus.TimeLimitExceeded or outcome.return_code != 0
    return RunCodeResponse(status=RunStatus.Failed if failed else RunStatus.Success, run_result=result)


def sandbox_error(message: str) -> RunCodeResponse:
    return RunCodeResponse(status=RunStatus.SandboxError, message=message)


class Executor:
    """Runs requests in the sandbox, at most `pool.size` at once, fairly between callers."""

    def __init__(
        self, sandbox: Sandbox, languages: dict[str, Language], policy: Policy, pool: SlotPool
    ) -> None:
        self.sandbox = sandbox
        self.languages = languages
        self.policy = policy
        self.pool = pool
        self.pod_name = os.environ.get("MY_POD_NAME")  # SandboxFusion's executor_pod_name

    def job_for(self, request: RunCodeRequest) -> Job:
        """The job a request describes, or LimitError naming the field over a limit."""
        language = self.languages.get(request.language)
        if language is None:
            raise LimitError(
                "language",
                f"{request.language[:40]!r} is not run here; use one of {', '.join(sorted(self.languages))}",
            )
        return Job(
            language=language,
            code=request.code.encode(errors="surrogatepass"),
            limits=limits_for(request, self.policy),
            stdin=(request.stdin or "").encode(errors="surrogatepass"),
            files={path: base64.b64decode(content) for path, content in request.files.items()},
        )

    async def run(self, jobs: Sequence[Job], deadline_s: float) -> list[RunCodeResponse]:
        """Each job's response, in order. A job still waiting for a slot at the deadline gets a
        SandboxError saying so; a running job is bounded by its own wall time."""
        group = object()  # one fair-queue group per call
        deadline = asyncio.get_running_loop().time() + deadline_s
        return list(await asyncio.gather(*(self._run_one(job, group, deadline) for job in jobs)))

    async def _run_one(self, job: Job, group: Hashable, deadline: float) -> RunCodeResponse:
        loop = asyncio.get_running_loop()
        slot = self.pool.slot(group)
        try:
            uid = await asyncio.wait_for(slot.__aenter__(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return sandbox_error("the request's deadline passed before a worker was free; send fewer runs")
        try:
            outcome = await run_job(self.sandbox, job, uid)
        finally:
            await slot.__aexit__(None, None, None)
        response = response_for(outcome)
        response.executor_pod_name = self.pod_name
        return response


def slot_uids(workers: int, uid_base: int, euid: int) -> list[int | None]:
    """Each slot's uid when the service is root (its own, so a run's process limit counts its own
    processes only); None (the service's uid) otherwise."""
    if euid != 0:
        return [None] * workers
    return [uid_base + index for index in range(workers)]


def check_uid_isolation(euid: int, shared_uid: bool) -> None:
    """Refuse to run every sandbox as one uid unless told to: RLIMIT_NPROC counts a uid's processes
    host-wide, so a fork bomb in one run would keep every other run (and the service's own
    subprocesses) from starting until it is killed."""
    if euid != 0 and not shared_uid:
        raise SandboxUnavailable(
            f"the service runs as uid {euid}, not root, so every run would share that uid and its process "
            "limit: a fork bomb in one run would stop all others from starting. Run it as root (each "
            "worker then runs its sandboxes as a uid of its own), or accept that risk with --shared-uid "
            "(CODE_EXECUTOR_SHARED_UID=true)"
        )


async def probe(executor: Executor) -> None:
    """Run a tiny program in every slot's uid; SandboxUnavailable if the sandbox cannot start here."""
    limits = limits_for(RunCodeRequest(code=""), executor.policy)
    job = Job(executor.languages["python"], PROBE_CODE, limits)
    for uid in executor.pool.uids:
        outcome = await run_job(executor.sandbox, job, uid)
        if outcome.error is not None or outcome.return_code != 0:
            why = outcome.error or outcome.stderr.decode(errors="replace").strip()
            raise SandboxUnavailable(explain(why))
        if outcome.stdout != PROBE_REFUSED:
            raise SandboxUnavailable(
                f"the sandbox's seccomp filter is not in force: the probe printed {outcome.stdout[:200]!r} "
                f"where memfd_create should have been refused ({executor.sandbox.bwrap} must take "
                "--seccomp), so runs could hold memory past their limit"
            )
        if outcome.usage.peak_memory_bytes == 0:
            raise SandboxUnavailable(
                "the usage guard saw no memory in use by the probe's processes: /proc does not show this "
                "service its runs, so the run-wide memory and CPU limits could not hold"
            )


def explain(why: str) -> str:
    hint = ""
    if "seccomp" in why.lower():
        hint = (
            " (every run gets a seccomp filter: the kernel needs CONFIG_SECCOMP_FILTER, and a container's "
            "own seccomp profile must let bubblewrap install one)"
        )
    elif any(s in why for s in ("namespace", "uid map", "Operation not permitted", "Permission denied")):
        hint = (
            " (user namespaces must be allowed: sysctl kernel.unprivileged_userns_clone=1 and "
            "user.max_user_namespaces>0; in Docker run the container with --security-opt seccomp=unconfined "
            "--security-opt apparmor=unconfined, or on Ubuntu 24.04 hosts allow bwrap in AppArmor)"
        )
    return (
        f"the sandbox cannot run programs here: {why[:500]}{hint}; "
        "the code-executor does not run code unsandboxed"
    )


def build_executor(
    *,
    bwrap: str | None,
    python: str | None,
    workers: int,
    uid_base: int,
    shared_uid: bool,
    max_queued: int,
    policy: Policy,
) -> Executor:
    """The executor for these settings, after proving it can run a program (SandboxUnavailable if not)."""
    check_uid_isolation(os.geteuid(), shared_uid)
    become_subreaper()
    uids = slot_uids(workers, uid_base, os.geteuid())
    interpreter = find_python(python, others_run_it=uids[0] is not None)
    sandbox = Sandbox(
        bwrap=find_bwrap(bwrap),
        prlimit=shutil.which("prlimit") or "/usr/bin/prlimit",
        setpriv=shutil.which("setpriv") or "/usr/bin/setpriv",
        system=system_binds([interpreter_prefix(interpreter)]),
        syscall_filter=syscall_filter(os.uname().machine),
    )
    for tool in (sandbox.prlimit, sandbox.setpriv):
        if not os.path.exists(tool):
            raise SandboxUnavailable(f"{tool} (util-linux) not found; it sets each run's limits and uid")
    executor = Executor(sandbox, languages_here(interpreter), policy, SlotPool(uids, max_queued))
    asyncio.run(probe(executor))
    return executor
