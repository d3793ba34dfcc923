"""`python -m jobgroup.local`: the group comes up healthy with prefixed logs, and every way it ends —
Ctrl-C, `down`, a failing trainer, a service dying, a service that never starts — leaves no process.

Real launcher processes, real services on loopback ports. The reward- and retrieval-servers join the
group as soon as their packages have a __main__ (they are being built alongside this launcher).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT

try:
    import psutil
except ImportError:  # then only the PIDs the launcher reports are checked
    psutil = None

DATA_ARGS = (
    "--datasets synthetic-arith=synthetic-arith:easy --synthetic-train-size 20 --synthetic-test-size 5"
)
CORPUS = [
    {"id": "1", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "2", "contents": '"Rome"\nRome is the capital of Italy.'},
    {"id": "3", "contents": '"Oslo"\nOslo is the capital of Norway.'},
]


def built(package: str) -> bool:
    return (ROOT / "services" / package / "__main__.py").exists()


def available_services() -> list[str]:
    return (
        ["data"]
        + (["reward"] if built("reward_server") else [])
        + (["retrieval"] if built("retrieval_server") else [])
    )


def launcher_argv(command: str, run_dir: Path, services: list[str], *extra: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "jobgroup.local",
        command,
        "--run-dir",
        str(run_dir),
        "--services",
        ",".join(services),
        "--data-port",
        "0",
        "--reward-port",
        "0",
        "--retrieval-port",
        "0",
        "--grace",
        "10",
        "--health-timeout",
        "120",
        "--data-server-args",
        DATA_ARGS,
    ]
    if "retrieval" in services:  # BM25: a real index without loading an embedding model
        corpus = run_dir.parent / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
        argv += ["--retrieval-corpus", str(corpus), "--retrieval-build-args", "--index bm25"]
    return argv + list(extra)


class Launcher:
    """A launcher process whose output goes to a file (a full pipe would stall the whole group)."""

    def __init__(self, argv: list[str], out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out.open("wb"), stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.text())
            if match:
                return match
            if self.proc.poll() is not None:
                pytest.fail(
                    f"launcher exited with {self.proc.returncode} before {pattern!r}:\n{self.text()[-4000:]}"
                )
            time.sleep(0.1)
        pytest.fail(f"no {pattern!r} within {timeout_s}s:\n{self.text()[-4000:]}")

    def exit_code(self, timeout_s: float = 40) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"launcher still running after {timeout_s}s:\n{self.text()[-4000:]}")

    def descendants(self) -> set[int]:
        if psutil is None:
            return set()
        return {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}

    def stop_if_running(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(40)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return True


def assert_all_gone(pids: set[int], timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if running(pid)], "processes outlived the launcher"


def up_group(tmp_path: Path, services: list[str], cleanup) -> tuple[Launcher, dict]:
    run_dir = tmp_path / "run"
    launcher = Launcher(launcher_argv("up", run_dir, services), tmp_path / "launcher.log")
    cleanup(launcher)
    launcher.wait_for(r"\[launcher\] group up:")
    return launcher, json.loads((run_dir / "state.json").read_text())


@pytest.fixture
def cleanup():
    launchers: list[Launcher] = []
    yield launchers.append
    for launcher in launchers:
        launcher.stop_if_running()


def test_up_serves_every_available_service_and_ctrl_c_stops_all(tmp_path, cleanup):
    services = available_services()
    launcher, state = up_group(tmp_path, services, cleanup)
    assert set(state["urls"]) == {f"{s}-server" for s in services}
    for name, url in state["urls"].items():
        assert httpx.get(url + "/health", timeout=5).status_code == 200, name
    if "retrieval" in services:
        found = httpx.post(
            state["urls"]["retrieval-server"] + "/retrieve",
            json={"queries": ["capital of Norway"], "topk": 1, "return_scores": True},
            timeout=10,
        ).json()
        assert found["result"][0][0]["document"]["id"] == "3"
    log = launcher.text()
    for name in state["urls"]:  # each service's own output, under its name
        assert re.search(rf"^\[{name}\] .*Uvicorn running", log, re.MULTILINE), name
    pids = launcher.descendants() | {c["pid"] for c in state["children"]}
    assert {c["pid"] for c in state["children"]} <= pids or psutil is None

    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.exit_code() == 0  # Ctrl-C is how `up` is meant to end
    assert_all_gone(pids)
    assert not (tmp_path / "run" / "state.json").exists()
    assert "[launcher] all stopped" in launcher.text()


def test_down_stops_a_group_started_with_up(tmp_path, cleanup):
    launcher, state = up_group(tmp_path, ["data"], cleanup)
    pids = launcher.descendants() | {c["pid"] for c in state["children"]}
    down = subprocess.run(
        [sys.executable, "-m", "jobgroup.local", "down", "--run-dir", str(tmp_path / "run")],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 0 and "stopped the group" in down.stdout
    assert launcher.exit_code() == 0
    assert "SIGTERM received" in launcher.text()
    assert_all_gone(pids)
    again = subprocess.run(
        [sys.executable, "-m", "jobgroup.local", "down", "--run-dir", str(tmp_path / "run")],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0 and "no group is up" in again.stdout


# The stand-in trainer checks what a trainer is given (URLs in env, KEY=VALUE args), leaves a
# grandchild behind in its process group, and fails.
FAILING_TRAINER = (
    "import os, subprocess, sys, httpx;"
    "urls = {k: v for k, v in os.environ.items() if k.endswith('_SERVER_URL')};"
    "codes = sorted({k: httpx.get(v + '/health').status_code for k, v in urls.items()}.items());"
    "sleeper = subprocess.Popen(['sleep', '300']);"
    "print('trainer saw', codes, sys.argv[1:], 'sleeper', sleeper.pid, flush=True);"
    "sys.exit(3)"
)


def test_failing_trainer_tears_the_group_down_with_its_exit_code(tmp_path, cleanup):
    services = [s for s in available_services() if s != "retrieval"]
    argv = launcher_argv(
        "run",
        tmp_path / "run",
        services,
        "--trainer-cmd",
        f'{sys.executable} -c "{FAILING_TRAINER}"',
        "trainer.total_epochs=1",
    )
    launcher = Launcher(argv, tmp_path / "launcher.log")
    cleanup(launcher)
    assert launcher.exit_code(timeout_s=120) == 3
    log = launcher.text()
    seen = re.search(
        r"^\[trainer\] trainer saw (.*) \['trainer.total_epochs=1'\] sleeper (\d+)$", log, re.MULTILINE
    )
    assert seen, log[-3000:]
    expected = sorted((f"{s.upper()}_SERVER_URL", 200) for s in services)
    assert seen.group(1) == str(expected)
    assert "[launcher] trainer finished with exit code 3" in log
    service_pids = {int(p) for p in re.findall(r"stopping \S+-server \(pid (\d+)\)", log)}
    assert len(service_pids) == len(services)
    assert_all_gone(service_pids | {int(seen.group(2))})  # the grandchild went with its process group


def test_a_service_dying_stops_the_group(tmp_path, cleanup):
    launcher, state = up_group(tmp_path, ["data"], cleanup)
    pids = launcher.descendants() | {c["pid"] for c in state["children"]}
    data_pid = next(c["pid"] for c in state["children"] if c["name"] == "data-server")
    os.kill(data_pid, signal.SIGKILL)
    assert launcher.exit_code() == 1
    assert "[launcher] error: data-server exited with code -9; stopping the group" in launcher.text()
    assert_all_gone(pids)


def test_a_service_that_never_gets_healthy_fails_the_launch(tmp_path, cleanup):
    argv = launcher_argv("up", tmp_path / "run", ["data"])
    argv[argv.index(DATA_ARGS)] = "--datasets broken=/no/such/folder"
    launcher = Launcher(argv, tmp_path / "launcher.log")
    cleanup(launcher)
    assert launcher.exit_code(timeout_s=60) == 1
    assert re.search(
        r"\[launcher\] error: data-server exited with code 1 before becoming healthy", launcher.text()
    )


def test_a_taken_port_is_refused_naming_the_service(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        argv = launcher_argv("up", tmp_path / "run", ["data"])
        argv[argv.index("--data-port") + 1] = str(port)
        result = subprocess.run(argv, cwd=ROOT, check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"error: data-server: port {port} is already in use" in result.stdout


@pytest.mark.parametrize(
    "flag, given, expected",
    [
        (None, False, ["data", "reward"]),
        (None, True, ["data", "reward", "retrieval"]),  # unset: an index given means retrieval
        ("false", True, ["data", "reward"]),  # the flag decides when set, in any spelling
        ("No", True, ["data", "reward"]),
        ("0", True, ["data", "reward"]),
        ("true", True, ["data", "reward", "retrieval"]),
        ("YES", True, ["data", "reward", "retrieval"]),
        ("1", True, ["data", "reward", "retrieval"]),
    ],
)
def test_use_retrieval_is_read_as_a_flag(tmp_path, monkeypatch, flag, given, expected):
    from jobgroup import local

    monkeypatch.delenv("USE_RETRIEVAL", raising=False)
    if flag is not None:
        monkeypatch.setenv("USE_RETRIEVAL", flag)
    extra = ["--retrieval-index", str(tmp_path)] if given else []
    assert local.chosen_services(local.parse_args(["up", *extra])) == expected


def test_use_retrieval_that_cannot_be_met_or_read_is_refused(tmp_path, monkeypatch):
    from jobgroup import local

    monkeypatch.setenv("USE_RETRIEVAL", "true")
    with pytest.raises(local.GroupFailure, match="USE_RETRIEVAL is on: give --retrieval-index"):
        local.chosen_services(local.parse_args(["up"]))
    monkeypatch.setenv("USE_RETRIEVAL", "maybe")
    with pytest.raises(local.GroupFailure, match="USE_RETRIEVAL=maybe is not a flag"):
        local.chosen_services(local.parse_args(["up", "--retrieval-index", str(tmp_path)]))
    done = subprocess.run(  # the launcher says so in one line and exits 1, starting nothing
        [sys.executable, "-m", "jobgroup.local", "up", "--run-dir", str(tmp_path / "run")],
        cwd=ROOT,
        env={**os.environ, "USE_RETRIEVAL": "maybe"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1 and "USE_RETRIEVAL=maybe is not a flag" in done.stdout


# ------------------------------------------------------------------------------ the code-executor


@pytest.mark.parametrize(
    "flag, expected",
    [(None, ["data", "reward"]), ("false", ["data", "reward"]), ("0", ["data", "reward"]),
     ("true", ["data", "reward", "code"]), ("Yes", ["data", "reward", "code"])],
)  # fmt: skip
def test_use_code_executor_is_read_as_a_flag_and_off_when_unset(monkeypatch, flag, expected):
    from jobgroup import local

    monkeypatch.delenv("USE_RETRIEVAL", raising=False)
    monkeypatch.delenv("USE_CODE_EXECUTOR", raising=False)
    if flag is not None:
        monkeypatch.setenv("USE_CODE_EXECUTOR", flag)
    assert local.chosen_services(local.parse_args(["up"])) == expected
    monkeypatch.setenv("USE_CODE_EXECUTOR", "maybe")
    with pytest.raises(local.GroupFailure, match="USE_CODE_EXECUTOR=maybe is not a flag"):
        local.chosen_services(local.parse_args(["up"]))


def test_the_retrieval_server_alone_trains_with_search_as_the_skypilot_group_does(tmp_path, monkeypatch):
    from jobgroup import local

    monkeypatch.delenv("USE_CODE_EXECUTOR", raising=False)
    monkeypatch.delenv("USE_RETRIEVAL", raising=False)
    ports = ["--data-port", "0", "--reward-port", "0", "--retrieval-port", "0"]
    opts = local.parse_args(["run", *ports, "--retrieval-index", str(tmp_path)])
    keys = dict(arg.split("=", 1) for arg in local.trainer_argv(opts, local.plan_services(opts))[3:])
    multi_turn = "actor_rollout_ref.rollout.multi_turn"
    # train.sh's USE_RETRIEVAL: the search tool's config, Search-R1's tags, up to 4 model turns
    assert keys[f"{multi_turn}.tool_config_path"].endswith("jobgroup/tools/search_tool_config.yaml")
    assert keys[f"{multi_turn}.format"] == "search_r1" and keys[f"{multi_turn}.max_assistant_turns"] == "4"
    data = {spec.name: spec for spec in local.plan_services(opts)}["data-server"].argv
    assert "--qa-instruction" not in data  # the data-server's default: Search-R1's tags, as trained


@pytest.mark.parametrize("with_search", [False, True])
def test_the_code_executor_url_reaches_the_reward_server_and_the_trainer(tmp_path, monkeypatch, with_search):
    from jobgroup import local

    monkeypatch.setenv("USE_CODE_EXECUTOR", "true")
    monkeypatch.delenv("USE_RETRIEVAL", raising=False)
    ports = ["--data-port", "0", "--reward-port", "0", "--retrieval-port", "0", "--code-port", "0"]
    search = ["--retrieval-index", str(tmp_path)] if with_search else []
    opts = local.parse_args(["run", *ports, *search, "trainer.total_training_steps=2"])
    services = {spec.name: spec for spec in local.plan_services(opts)}
    code = services["code-executor"]
    assert code.argv[2] == "services.code_executor" and code.url == f"http://127.0.0.1:{code.port}"
    reward = list(services["reward-server"].argv)
    assert reward[reward.index("--code-executor-url") + 1] == code.url  # code rows scored there
    assert local.child_env(list(services.values()))["CODE_EXECUTOR_URL"] == code.url  # the tool config's
    # the code-executor's token: the reward-server sends it with code rows, the trainer with its tool calls
    monkeypatch.setenv("CODE_EXECUTOR_AUTH_TOKEN", "s3cret")
    env = local.child_env(list(services.values()))
    assert env["REWARD_SERVER_CODE_EXECUTOR_TOKEN"] == env["SERVICES_AUTH_TOKEN"] == "s3cret"
    argv = local.trainer_argv(opts, list(services.values()))
    keys = dict(arg.split("=", 1) for arg in argv[3:])
    tools = "search_code_tool_config.yaml" if with_search else "code_tool_config.yaml"
    multi_turn = "actor_rollout_ref.rollout.multi_turn"
    assert keys[f"{multi_turn}.tool_config_path"] == str(ROOT / "jobgroup" / "tools" / tools)
    assert keys[f"{multi_turn}.enable"] == "true" and keys[f"{multi_turn}.format"] == "hermes"
    # hermes: QA prompts ask for the tools the chat template shows, not Search-R1's tags
    data = list(services["data-server"].argv)
    assert data[data.index("--qa-instruction") + 1] == "tools"
    assert ("services.retrieval_url" in keys) == with_search
    assert argv[-1] == "trainer.total_training_steps=2"  # the user's keys come last and win


# The stand-in trainer runs a program on the code-executor and has the reward-server score a code row
# (its test case runs on the code-executor too), then exits 0.
CODE_TRAINER = """
import os, sys, httpx
ran = httpx.post(os.environ["CODE_EXECUTOR_URL"] + "/run_code", json={"code": "print(6 * 7)"}, timeout=60)
row = {"data_source": "codecontests", "response": "```python\\nprint(int(input()) * 2)\\n```",
       "ground_truth": {"inputs": ["3\\n"], "outputs": ["6\\n"]}}
scored = httpx.post(os.environ["REWARD_SERVER_URL"] + "/v1/rewards", json={"items": [row]}, timeout=60)
print("trainer saw", ran.json()["run_result"]["stdout"].strip(), scored.json()["results"][0], flush=True)
"""


def test_run_with_the_code_executor_wires_it_to_the_reward_server_and_the_trainer(tmp_path, cleanup):
    from tests.helpers import code_sandbox_missing

    if code_sandbox_missing():
        pytest.skip(f"the code-executor cannot start here: {code_sandbox_missing()}")
    script = tmp_path / "trainer.py"
    script.write_text(CODE_TRAINER)
    argv = launcher_argv(
        "run", tmp_path / "run", ["data", "reward", "code"], "--code-port", "0",
        "--code-executor-args", "--workers 1", "--trainer-cmd", f"{sys.executable} {script}",
    )  # fmt: skip
    launcher = Launcher(argv, tmp_path / "launcher.log")
    cleanup(launcher)
    assert launcher.exit_code(timeout_s=180) == 0, launcher.text()[-4000:]
    log = launcher.text()
    assert re.search(r"^\[launcher\] code-executor healthy at http://127\.0\.0\.1:\d+$", log, re.MULTILINE)
    assert re.search(r"^\[launcher\] starting reward-server: .* --code-executor-url http://127", log, re.M)
    seen = re.search(r"^\[trainer\] trainer saw 42 (.*)$", log, re.MULTILINE)
    assert seen, log[-3000:]
    assert "'score': 1.0" in seen.group(1) and "'correct': True" in seen.group(1)
