"""Start rollout servers next to the trainer: one `python -m sglang.launch_server` per GPU (or TP group);
wait until each answers /health; stop them on exit.

`rollout.name=sglang` uses this when no server URLs are given. Flags are SGLang 0.5.23's
(sglang/srt/arg_groups/fields/: --model-path, --tp-size, --mem-fraction-static, --enable-memory-saver,
--dtype, --host, --port, --enable-deterministic-inference). --enable-memory-saver is what makes
/release_memory_occupation work for a colocated trainer; --enable-deterministic-inference is what makes
SGLang honour a request's sampling_seed (sampling_batch_info.py reads the seeds only in that mode), and
the fit loop seeds every sample (trainer.seed).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sglang_command(
    model_path: str,
    *,
    port: int,
    tp_size: int = 1,
    mem_fraction_static: float | None = None,
    deterministic_inference: bool = False,
    trust_remote_code: bool = False,
    tokenizer_path: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """deterministic_inference: seeded sampling (batch-invariant kernels, at some cost in throughput).
    trust_remote_code: the model's or the tokenizer's own code may run. tokenizer_path: a tokenizer
    other than the model's (data.tokenizer: the one the driver tokenizes prompts with)."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--tp-size", str(tp_size), "--dtype", "bfloat16"]
    if mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(mem_fraction_static)]
    argv.append("--enable-memory-saver")
    if deterministic_inference:
        argv.append("--enable-deterministic-inference")
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if tokenizer_path:
        argv += ["--tokenizer-path", tokenizer_path]
    return argv + list(extra_args)


def gpu_groups(gpus: Sequence[str], tp_size: int) -> list[str]:
    """["0","1","2","3"], tp 2 -> ["0,1", "2,3"]: the CUDA_VISIBLE_DEVICES of each server."""
    if tp_size < 1 or len(gpus) % tp_size:
        raise ValueError(f"{len(gpus)} GPUs do not split into tensor-parallel groups of {tp_size}")
    return [",".join(gpus[i : i + tp_size]) for i in range(0, len(gpus), tp_size)]


@dataclass
class ServerProcess:
    argv: list[str]
    url: str
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    process: subprocess.Popen | None = None

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-3000:]


class RolloutServers:
    """A set of rollout server processes (a context manager: started on enter, stopped on exit)."""

    def __init__(self, servers: Sequence[ServerProcess]) -> None:
        self.servers = list(servers)
        self.log_dir = Path(tempfile.mkdtemp(prefix="rollout-servers-"))

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self, timeout_s: float = 900.0) -> RolloutServers:
        try:
            for index, server in enumerate(self.servers):
                server.log_path = self.log_dir / f"server-{index}.log"
                with open(server.log_path, "w") as log:
                    server.process = subprocess.Popen(
                        server.argv,
                        env={**os.environ, "PYTHONUNBUFFERED": "1", **server.env},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.servers)
        while pending:
            for server in list(pending):
                code = server.process.poll() if server.process else None
                if code is not None:
                    raise RuntimeError(
                        f"rollout server {server.url} exited with {code}:\n{server.log_tail()}"
                    )
                try:
                    if httpx.get(server.url + "/health", timeout=5.0).status_code == 200:
                        pending.remove(server)
                except httpx.TransportError:
                    pass
            if pending and time.monotonic() > deadline:
                urls = ", ".join(s.url for s in pending)
                raise TimeoutError(f"rollout servers not healthy within {timeout_s:.0f}s: {urls}")
            if pending:
                time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> None:
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                os.killpg(server.process.pid, signal.SIGTERM)
        for server in self.servers:
            if server.process is None:
                continue
            try:
                server.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait()

    def __enter__(self) -> RolloutServers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def sglang_servers(
    model_path: str, gpus: Sequence[str], *, tp_size: int = 1, **command_kwargs
) -> RolloutServers:
    """One SGLang server per tensor-parallel group of `gpus`, on loopback (not started: use `with` or
    .start())."""
    servers = []
    for visible in gpu_groups(gpus, tp_size):
        port = free_port()
        argv = sglang_command(model_path, port=port, tp_size=tp_size, **command_kwargs)
        servers.append(ServerProcess(argv, f"http://127.0.0.1:{port}", {"CUDA_VISIBLE_DEVICES": visible}))
    return RolloutServers(servers)
