"""The whole job group on one machine: `python -m jobgroup.local up | run | down`.

    up    start the services on loopback, wait for each /health, keep them up until Ctrl-C, SIGTERM or `down`
    run   the same, then the trainer (`python -m trainer.main_ppo KEY=VALUE ...` with services.* pointing at
          them); the group ends with the trainer and the launcher exits with the trainer's code
    down  stop a group that `up` started elsewhere (it reads RUN_DIR/state.json)

Services: data-server :8000, reward-server :8001, retrieval-server :8002 (only with an index:
--retrieval-index DIR, or --retrieval-corpus FILE.jsonl to build one first), code-executor :8003 (only
when asked: USE_CODE_EXECUTOR=true, or `code` in --services; it needs bubblewrap and user namespaces,
and refuses to start without them, or as a user other than root unless CODE_EXECUTOR_SHARED_UID=true
accepts that all runs share one uid's process limit). USE_RETRIEVAL and USE_CODE_EXECUTOR are flags
(true/false, 1/0, yes/no) as in the SkyPilot job group; USE_RETRIEVAL decides when set: false leaves the
retrieval-server out even with an index, true requires one. With the retrieval-server in the group,
`run` trains with search (the trainer gets actor_rollout_ref.rollout.multi_turn.enable=true); with the
code-executor, the reward-server gets --code-executor-url and `run` trains with the code interpreter
(jobgroup/tools/code_tool_config.yaml, or search_code_tool_config.yaml with search too; format hermes).
Their output is printed line by line as `[data-server] ...` and kept in RUN_DIR/logs/.

No orphans: every child runs in its own process group, and teardown sends SIGTERM to each group, then
SIGKILL to what is left after --grace seconds. Any failure — a service exiting, a health wait timing
out, the trainer failing — tears the whole group down and exits non-zero.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from jobgroup.flags import env_flag

POLL_S = 0.2


@dataclass(frozen=True)
class Defaults:
    """Every default of the launcher, in one place."""

    run_dir: Path = Path("runs/local")
    data_port: int = 8000
    reward_port: int = 8001
    retrieval_port: int = 8002
    code_port: int = 8003
    health_timeout_s: float = 300.0  # the retrieval-server loads its index and embedder before /health
    grace_s: float = 15.0  # a little over the services' own graceful drain (10 s)


@dataclass(frozen=True)
class ServiceKind:
    """What the launcher knows of one service: how to serve it and how the trainer finds it."""

    name: str  # its name in the logs, state.json and error messages
    command: tuple[str, ...]  # python -m ..., before the flags every service shares
    url_var: str  # env var the trainer's clients (or its tool config) read
    url_key: str | None  # trainer config key; None: the tool config reads url_var


# By the key --services names them with.
SERVICE_KINDS = {
    "data": ServiceKind("data-server", ("services.data_server",), "DATA_SERVER_URL", "services.data_url"),
    "reward": ServiceKind(
        "reward-server", ("services.reward_server",), "REWARD_SERVER_URL", "services.reward_url"
    ),
    "retrieval": ServiceKind(
        "retrieval-server",
        ("services.retrieval_server", "serve"),
        "RETRIEVAL_SERVER_URL",
        "services.retrieval_url",
    ),
    "code": ServiceKind("code-executor", ("services.code_executor",), "CODE_EXECUTOR_URL", None),
}
TOOL_CONFIGS = Path(__file__).resolve().parent / "tools"


@dataclass(frozen=True)
class ServiceSpec:
    """One service to start: its command line and how the trainer finds it."""

    name: str
    argv: tuple[str, ...]
    port: int
    url_var: str  # env var the trainer's clients read
    url_key: str | None  # trainer config key (None: read from url_var by the tool config)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class GroupFailure(RuntimeError):
    """Something the group cannot go on without: the message names the part that failed."""


class Stopped(Exception):
    """SIGINT / SIGTERM arrived."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ------------------------------------------------------------------------------------ output


_print_lock = threading.Lock()


def say(source: str, text: str) -> None:
    with _print_lock:
        sys.stdout.write(f"[{source}] {text}\n")
        sys.stdout.flush()


def _pump(name: str, stream, log_path: Path) -> None:
    """Copy a child's output to our stdout with its name in front, and to its log file."""
    with open(log_path, "ab") as log_file:
        for raw in iter(stream.readline, b""):
            log_file.write(raw)
            log_file.flush()
            say(name, raw.decode("utf-8", errors="replace").rstrip("\n"))
    stream.close()


# ------------------------------------------------------------------------------------ processes


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by its parent counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def cmdline(pid: int) -> str | None:
    """The command line of a process, or None where /proc cannot tell."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    argv: tuple[str, ...]
    pump: threading.Thread


@dataclass
class ProcessGroup:
    """The children of one launcher, each in its own process group, stopped together."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: tuple[str, ...], env: dict[str, str]) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        say("launcher", f"starting {name}: {shlex.join(argv)}")
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: the terminal's Ctrl-C reaches only us
        )
        pump = threading.Thread(
            target=_pump, args=(name, proc.stdout, self.log_dir / f"{name}.log"), daemon=True
        )
        child = Child(name, proc, argv, pump)
        self.children.append(child)
        pump.start()
        return child

    def forget(self, child: Child) -> None:
        """A one-shot step (the index build) that ended: reaped, no longer part of the group."""
        child.proc.wait()
        child.pump.join(timeout=5)
        self.children.remove(child)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop_all(self, grace_s: float) -> None:
        """SIGTERM every group (newest first), SIGKILL whatever is left after grace_s, reap everything."""
        live = [c for c in reversed(self.children) if c.proc.poll() is None or group_alive(c.proc.pid)]
        for child in live:
            say("launcher", f"stopping {child.name} (pid {child.proc.pid})")
            signal_group(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while live and time.monotonic() < deadline:
            live = [c for c in live if c.proc.poll() is None or group_alive(c.proc.pid)]
            time.sleep(0.05)
        for child in live:
            say("launcher", f"{child.name} still running after {grace_s:.0f}s: SIGKILL")
            signal_group(child.proc.pid, signal.SIGKILL)
        for child in self.children:
            child.proc.wait()
            child.pump.join(timeout=5)


class StopSignals:
    """SIGINT / SIGTERM set a flag the polling loops check: no exception lands mid-spawn."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise Stopped(self.signum)

    @staticmethod
    def ignore() -> None:
        """During teardown: finish it rather than leave children behind."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)


# ------------------------------------------------------------------------------------ planning


def module_available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module + ".__main__") is not None
    except ModuleNotFoundError:
        return False


def choose_port(port: int, name: str) -> int:
    """Port 0 picks a free one; a taken port is an error naming the service."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise GroupFailure(
                f"{name}: port {port} is already in use (choose another with --{name.split('-')[0]}-port)"
            ) from None
        return sock.getsockname()[1]


def chosen_services(opts: argparse.Namespace) -> list[str]:
    if opts.services:
        names = [s.strip() for s in opts.services.split(",") if s.strip()]
        unknown = sorted(set(names) - set(SERVICE_KINDS))
        if unknown:
            raise GroupFailure(f"--services: unknown {unknown}; choose from {', '.join(SERVICE_KINDS)}")
        if "retrieval" in names and not (opts.retrieval_index or opts.retrieval_corpus):
            raise GroupFailure("retrieval needs --retrieval-index DIR or --retrieval-corpus FILE.jsonl")
        return names
    names = ["data", "reward"]
    if retrieval_wanted(opts):
        names.append("retrieval")
    if read_flag("USE_CODE_EXECUTOR"):  # unset is off: the code-executor runs untrusted programs
        names.append("code")
    return names


def read_flag(name: str) -> bool | None:
    try:
        return env_flag(name)
    except ValueError as exc:
        raise GroupFailure(str(exc)) from None


def retrieval_wanted(opts: argparse.Namespace) -> bool:
    """USE_RETRIEVAL decides when it is set; otherwise an index or a corpus given means yes."""
    given = bool(opts.retrieval_index or opts.retrieval_corpus)
    flag = read_flag("USE_RETRIEVAL")
    if flag and not given:
        raise GroupFailure("USE_RETRIEVAL is on: give --retrieval-index DIR or --retrieval-corpus FILE.jsonl")
    return given if flag is None else flag


def retrieval_index_path(opts: argparse.Namespace) -> Path:
    """The index to serve: the one given, else the one built from --retrieval-corpus under --run-dir."""
    return Path(opts.retrieval_index) if opts.retrieval_index else opts.run_dir / "retrieval-index"


def plan_services(opts: argparse.Namespace) -> list[ServiceSpec]:
    """Ports first (the reward-server's command names the code-executor's), then each command line."""
    keys = chosen_services(opts)
    ports = {key: choose_port(getattr(opts, f"{key}_port"), SERVICE_KINDS[key].name) for key in keys}
    specs = []
    for key in keys:
        kind = SERVICE_KINDS[key]
        own: tuple[str, ...] = ()
        if key == "retrieval":
            own = ("--index", str(retrieval_index_path(opts)))
        if key == "reward" and "code" in ports:  # code rows: their test cases run on the code-executor
            own = ("--code-executor-url", f"http://127.0.0.1:{ports['code']}")
        if key == "data" and "code" in ports:  # the trainer speaks hermes (trainer_argv): QA prompts too
            own = ("--qa-instruction", "tools")
        extra = shlex.split(getattr(opts, f"{kind.name.replace('-', '_')}_args") or "")
        argv = (sys.executable, "-m", *kind.command, *own, "--host", "127.0.0.1",
                "--log-format", "text", "--port", str(ports[key]), *extra)  # fmt: skip
        specs.append(ServiceSpec(kind.name, argv, ports[key], kind.url_var, kind.url_key))
    return specs


def trainer_argv(opts: argparse.Namespace, services: list[ServiceSpec]) -> tuple[str, ...]:
    """The default trainer gets services.* keys first, so the user's own KEY=VALUE args win. With the
    retrieval-server or the code-executor in the group it trains with their tools (multi-turn tool
    calls), as USE_RETRIEVAL / USE_CODE_EXECUTOR do in the SkyPilot group; the code interpreter's
    tool config reads CODE_EXECUTOR_URL (and the search's RETRIEVAL_SERVER_URL) from the environment.
    `actor_rollout_ref.rollout.multi_turn.enable=false` turns the tools off."""
    if opts.trainer_cmd:
        return (*shlex.split(opts.trainer_cmd), *opts.overrides)
    keys = [f"{s.url_key}={s.url}" for s in services if s.url_key]
    names = {s.name for s in services}
    multi_turn = "actor_rollout_ref.rollout.multi_turn"
    if "code-executor" in names:
        config = "search_code_tool_config.yaml" if "retrieval-server" in names else "code_tool_config.yaml"
        keys += [
            f"{multi_turn}.enable=true",
            f"{multi_turn}.tool_config_path={TOOL_CONFIGS / config}",
            f"{multi_turn}.format=hermes",  # Search-R1's tags call the search tool alone
        ]
    elif "retrieval-server" in names:  # as train.sh's USE_RETRIEVAL: Search-R1's tags, up to 4 turns
        keys += [
            f"{multi_turn}.enable=true",
            f"{multi_turn}.tool_config_path={TOOL_CONFIGS / 'search_tool_config.yaml'}",
            f"{multi_turn}.format=search_r1",
            f"{multi_turn}.max_assistant_turns=4",
        ]
    return (sys.executable, "-m", "trainer.main_ppo", *keys, *opts.overrides)


def child_env(services: list[ServiceSpec]) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **{s.url_var: s.url for s in services}}
    token = env.get("CODE_EXECUTOR_AUTH_TOKEN")
    if token:  # the code-executor's token, shared by the group as serve_reward.sh and train.sh share it
        env.setdefault("REWARD_SERVER_CODE_EXECUTOR_TOKEN", token)
        env.setdefault("SERVICES_AUTH_TOKEN", token)
    return env


# ------------------------------------------------------------------------------------ state file


def state_path(run_dir: Path) -> Path:
    return run_dir / "state.json"


def write_state(run_dir: Path, group: ProcessGroup, services: list[ServiceSpec]) -> None:
    state = {
        "launcher_pid": os.getpid(),
        "children": [{"name": c.name, "pid": c.proc.pid, "argv": list(c.argv)} for c in group.children],
        "urls": {s.name: s.url for s in services},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_path(run_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(state_path(run_dir))


def read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads(state_path(run_dir).read_text())
    except (OSError, ValueError):
        return None


def refuse_if_running(run_dir: Path) -> None:
    state = read_state(run_dir)
    if (
        state
        and pid_alive(state["launcher_pid"])
        and "jobgroup.local" in (cmdline(state["launcher_pid"]) or "jobgroup.local")
    ):
        raise GroupFailure(
            f"a group is already up under {run_dir} (launcher pid {state['launcher_pid']}); "
            f"stop it with `python -m jobgroup.local down --run-dir {run_dir}`"
        )


# ------------------------------------------------------------------------------------ running


def wait_healthy(child: Child, url: str, timeout_s: float, stop: StopSignals) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        stop.check()
        if child.proc.poll() is not None:
            raise GroupFailure(
                f"{child.name} exited with code {child.proc.returncode} before becoming healthy"
            )
        try:
            response = httpx.get(url + "/health", timeout=2.0)
            if response.status_code == 200:
                say("launcher", f"{child.name} healthy at {url}")
                return
            last = f"HTTP {response.status_code}"
        except httpx.TransportError as exc:
            last = type(exc).__name__
        if time.monotonic() > deadline:
            raise GroupFailure(
                f"{child.name} not healthy within {timeout_s:.0f}s at {url}/health (last: {last})"
            )
        time.sleep(POLL_S)


def run_to_end(group: ProcessGroup, name: str, argv: tuple[str, ...], env: dict, stop: StopSignals) -> int:
    child = group.start(name, argv, env)
    while child.proc.poll() is None:
        stop.check()
        time.sleep(POLL_S)
    group.forget(child)
    return child.proc.returncode


def build_retrieval_index(opts: argparse.Namespace, group: ProcessGroup, stop: StopSignals) -> None:
    """Build the index from --retrieval-corpus unless it was given or already built."""
    index = retrieval_index_path(opts)
    if opts.retrieval_index or not opts.retrieval_corpus or "retrieval" not in chosen_services(opts):
        return
    if (index / "manifest.json").exists():
        say("launcher", f"reusing the retrieval index in {index}")
        return
    build = (
        "services.retrieval_server",
        "build",
        "--corpus",
        str(opts.retrieval_corpus),
        "--out",
        str(index),
    )
    argv = (sys.executable, "-m", *build, *shlex.split(opts.retrieval_build_args or ""))
    code = run_to_end(group, "retrieval-build", argv, child_env([]), stop)
    if code != 0:
        raise GroupFailure(
            f"building the retrieval index from {opts.retrieval_corpus} failed (exit code {code})"
        )


def supervise(group: ProcessGroup, stop: StopSignals, trainer: Child | None) -> int:
    """Until the trainer ends (run), a child fails, or a signal comes (up: the normal way to stop)."""
    while True:
        stop.check()
        exited = group.first_exited()
        if exited is trainer and trainer is not None:
            code = trainer.proc.returncode
            say("launcher", f"trainer finished with exit code {code}")
            return code
        if exited is not None:
            say(
                "launcher",
                f"error: {exited.name} exited with code {exited.proc.returncode}; stopping the group",
            )
            return 1
        time.sleep(POLL_S)


def start_group(opts: argparse.Namespace, group: ProcessGroup, stop: StopSignals) -> int:
    refuse_if_running(opts.run_dir)
    services = plan_services(opts)  # ports and modules checked before any slow step
    for spec in services:
        if not module_available(spec.argv[2]):
            raise GroupFailure(f"{spec.name}: python -m {spec.argv[2]} is not available in this environment")
    write_state(opts.run_dir, group, services)  # `down` works from here on, even during the index build
    build_retrieval_index(opts, group, stop)
    env = child_env(services)
    started = [(spec, group.start(spec.name, spec.argv, env)) for spec in services]
    write_state(opts.run_dir, group, services)
    for spec, child in started:
        wait_healthy(child, spec.url, opts.health_timeout, stop)
    say("launcher", "group up: " + ", ".join(f"{s.name} {s.url}" for s in services))
    if opts.command == "up":
        say("launcher", f"Ctrl-C, or `python -m jobgroup.local down --run-dir {opts.run_dir}`, stops it")
        return supervise(group, stop, trainer=None)
    trainer = group.start("trainer", trainer_argv(opts, services), env)
    write_state(opts.run_dir, group, services)
    return supervise(group, stop, trainer)


def launch(opts: argparse.Namespace) -> int:
    group = ProcessGroup(opts.run_dir / "logs")
    stop = StopSignals()
    try:
        return start_group(opts, group, stop)
    except Stopped as exc:
        say("launcher", f"{exc} received: stopping the group")
        return 0 if opts.command == "up" else 128 + exc.signum
    except GroupFailure as exc:
        say("launcher", f"error: {exc}")
        return 1
    finally:
        StopSignals.ignore()
        group.stop_all(opts.grace)
        state = read_state(opts.run_dir)
        if state and state.get("launcher_pid") == os.getpid():
            state_path(opts.run_dir).unlink(missing_ok=True)
        say("launcher", "all stopped")


def down(run_dir: Path, grace_s: float) -> int:
    """Stop the group `up` started under run_dir: ask its launcher, then make sure of every child."""
    state = read_state(run_dir)
    if state is None:
        print(f"no group is up under {run_dir}")
        return 0
    launcher = state["launcher_pid"]
    if pid_alive(launcher) and "jobgroup.local" in (cmdline(launcher) or "jobgroup.local"):
        os.kill(launcher, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 10
        while pid_alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.1)
    leftovers = [
        c
        for c in state["children"]
        if group_alive(c["pid"])
        and (cmdline(c["pid"]) is None or shlex.join(c["argv"][1:3]) in cmdline(c["pid"]))
    ]
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for child in leftovers:
            signal_group(child["pid"], signum)
        deadline = time.monotonic() + grace_s
        while any(group_alive(c["pid"]) for c in leftovers) and time.monotonic() < deadline:
            time.sleep(0.1)
    state_path(run_dir).unlink(missing_ok=True)
    print(f"stopped the group under {run_dir} (launcher pid {launcher})")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = Defaults()
    parser = argparse.ArgumentParser(
        prog="python -m jobgroup.local",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "run", "down"])
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="run: trainer config keys (verl names)."
    )
    parser.add_argument(
        "--run-dir", type=Path, default=d.run_dir, help=f"State file and logs (default {d.run_dir})."
    )
    parser.add_argument(
        "--services",
        help="Comma-separated subset of data,reward,retrieval,code (default: data,reward, plus "
        "retrieval when an index or corpus is given, plus code with USE_CODE_EXECUTOR=true).",
    )
    for key, kind in SERVICE_KINDS.items():
        parser.add_argument(
            f"--{key}-port",
            type=int,
            default=getattr(d, f"{key}_port"),
            help=f"{kind.name} port (0: any free one).",
        )
        parser.add_argument(f"--{kind.name}-args", help=f"Extra {kind.name} flags, one shell-quoted string.")
    parser.add_argument("--retrieval-index", type=Path, help="Index folder for the retrieval-server.")
    parser.add_argument(
        "--retrieval-corpus", type=Path, help="Corpus .jsonl to build an index from (under --run-dir)."
    )
    parser.add_argument(
        "--retrieval-build-args", help="Extra `retrieval_server build` flags, e.g. '--index hnsw'."
    )
    parser.add_argument(
        "--trainer-cmd",
        help="Run this command instead of python -m trainer.main_ppo (the service URLs are in "
        "DATA_SERVER_URL, REWARD_SERVER_URL, RETRIEVAL_SERVER_URL, CODE_EXECUTOR_URL).",
    )
    parser.add_argument(
        "--health-timeout", type=float, default=d.health_timeout_s, help="Seconds per service."
    )
    parser.add_argument("--grace", type=float, default=d.grace_s, help="Seconds between SIGTERM and SIGKILL.")
    opts = parser.parse_intermixed_args(argv)
    if opts.overrides and opts.command != "run":
        parser.error(f"KEY=VALUE arguments are for `run`, not `{opts.command}`")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.command == "down":
        return down(opts.run_dir, opts.grace)
    return launch(opts)


if __name__ == "__main__":
    sys.exit(main())
