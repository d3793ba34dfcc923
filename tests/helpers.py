"""Test helpers: free loopback ports and real service processes (python -m services.X, the rollout server)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            response = httpx.get(url + "/health", timeout=2.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code} {response.text[:200]}"
        except httpx.TransportError as exc:
            last = type(exc).__name__
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s: {last}")


@contextlib.contextmanager
def service_process(
    module: str, *args: str, port: int | None = None, env: dict | None = None, timeout_s: float = 120.0
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `python -m <module> <args> --host 127.0.0.1 --port P`, yield (base_url, process) once healthy.

    A thread reads the process's output as it comes (`output_of(proc)` returns it): a pipe nobody reads
    fills after 64 KiB, and a server that logs more than that would then block on its next write."""
    port = port or free_port()
    cmd = [sys.executable, "-m", module, *args, "--host", "127.0.0.1", "--port", str(port)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    proc.lines = []
    proc.reader = threading.Thread(target=_collect, args=(proc,), daemon=True)
    proc.reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, timeout_s, proc)
        except Exception:
            stop_process(proc)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{output_of(proc)[-4000:]}") from None
        yield url, proc
    finally:
        stop_process(proc)


def _collect(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        proc.lines.append(line)


def output_of(proc: subprocess.Popen) -> str:
    """What a service_process printed so far (all of it once the process has exited)."""
    if proc.poll() is not None:
        proc.reader.join(10)
    return "".join(proc.lines)


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def builtin_servers(model_path: str, count: int, *args: str):
    """`count` built-in rollout servers on CPU (python -m trainer.rollout.server <args>), not started: the
    launcher's RolloutServers, as rollout.name=sglang gets SGLang's."""
    from trainer.rollout.launcher import RolloutServers, ServerProcess

    servers = []
    for _ in range(count):
        port = free_port()
        argv = [sys.executable, "-m", "trainer.rollout.server", "--model", model_path, "--device", "cpu"]
        argv += ["--host", "127.0.0.1", "--port", str(port), *args]
        servers.append(ServerProcess(argv, f"http://127.0.0.1:{port}"))
    return RolloutServers(servers)


def small_data_server(train_size: int = 20, test_size: int = 5):
    """A real data-server with a tiny synthetic-arith set: for tests that just need a live service."""
    return service_process(
        "services.data_server",
        "--datasets",
        "synthetic-arith=synthetic-arith:easy",
        "--synthetic-train-size",
        str(train_size),
        "--synthetic-test-size",
        str(test_size),
    )


# The code-executor's own start-up check, in a child: it makes its process a subreaper, which a test
# process had better not become.
_SANDBOX_PROBE = """
import sys
from services.code_executor.app import CodeExecutorSettings, make_executor
from services.code_executor.sandbox import SandboxUnavailable
try:
    make_executor(CodeExecutorSettings(workers=1))
except SandboxUnavailable as exc:
    sys.exit(str(exc))
"""


@functools.cache
def code_sandbox_missing() -> str | None:
    """Why the code-executor cannot start on this host (no bubblewrap, no user namespaces), else None."""
    done = subprocess.run(
        [sys.executable, "-c", _SANDBOX_PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no reason given"])[-1]


@contextlib.contextmanager
def code_executor_with_token(token: str, uid_base: int) -> Iterator[str]:
    """A real one-worker code-executor that asks for `token` (its URL); skips the test where no sandbox
    can run. uid_base: the sandbox's uids, distinct per test module (the modules may run side by side)."""
    import pytest

    if (why := code_sandbox_missing()) is not None:
        pytest.skip(f"no code sandbox here: {why}")
    args = ("--workers", "1", "--uid-base", str(uid_base), "--auth-token", token, "--log-level", "warning")
    with service_process("services.code_executor", *args) as (url, _):
        yield url
