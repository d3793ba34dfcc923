"""docker/compose.multinode.yaml: the job group as SkyPilot runs it, its trainer on two nodes (two
containers, one Ray cluster over the compose network), and a node lost mid-run.

Without an engine: the trainer nodes run jobgroup/verl-grpo.yaml's verl-trainer `run:` line for line;
the services answer to the job-group names that run exports; node IPs, ranks and the checkpoint volume
agree; the images are built exactly as compose.yaml + compose.cpu.yaml build them (one build for both).

With one (marker docker), one scenario, phase by phase, its times printed past pytest's capture: GRPO
with Search-R1 tool calls (both retrieval replicas, the compose `search` profile) and the reward-server's
rewards, on a tiny model taught the format first (testing/search.py: a random one never calls the tool):
  up -> the Ray cluster of 2 nodes -> steps 1 and 2 with a rank on each node (the dashboard's state API)
  -> node 1's container killed in step 3 -> the run stops within a bound, naming node 1; checkpoint 2
  intact, with both ranks' shards on the shared volume -> the group restarted (a `sky jobs` recovery)
  resumes at step 3; the reward-server container killed there and restarted: the trainer retries ->
  step 4 -> the prompts trained on are the data-server's order, what an uninterrupted run trains on
  (tests/e2e/test_train_e2e.py holds that on one machine): none skipped, none repeated.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.test_compose import (
    COMPOSE as SINGLE_HOST,
)
from tests.e2e.test_compose import (
    CPU_OVERLAY,
    IMAGES_BUILT,
    gsm8k_folder,
    release_disk,
    stage_cpu_torch,
    start_docker,
    with_defaults,
)
from testing.search import (
    SEARCH_RESULT_TOKENS,
    short_search_row,
    teach_search_format,
    write_corpus,
    write_search_rows,
)
from tests.e2e.test_jobgroup_yaml import exported_urls
from tests.helpers import ROOT

COMPOSE_FILE = "docker/compose.multinode.yaml"
COMPOSE = yaml.safe_load((ROOT / COMPOSE_FILE).read_text())
SERVICES = COMPOSE["services"]
NODES = ["trainer-0", "trainer-1"]
GROUP = "verl-grpo"  # JOBGROUP_NAME's default
YAML_RUN = next(
    doc["run"]
    for doc in yaml.safe_load_all((ROOT / "jobgroup/verl-grpo.yaml").read_text())
    if doc and doc.get("name") == "verl-trainer"
)
PORTS = {"data-server": 8000, "reward-server": 8001, "retrieval-server": 8002}


def node_script(node: str) -> list[str]:
    """A trainer node's bash script as the container runs it (compose's $$ is a $)."""
    command = SERVICES[node]["command"]
    assert command[:2] == ["bash", "-c"], command
    return command[2].replace("$$", "$").splitlines()


def env_of(node: str) -> dict[str, str]:
    return {key: with_defaults(value) for key, value in SERVICES[node]["environment"].items()}


def test_trainer_nodes_run_the_yaml_run_section_line_for_line():
    run = [line for line in YAML_RUN.splitlines() if line.strip()]
    assert run[0] == "source ~/rl-venv/bin/activate"  # the image has its venv on PATH instead
    for node in NODES:
        script = node_script(node)
        assert script[:-1] == run[1:-1], node
        assert script[-1].startswith(run[-1] + " "), script[-1]  # only keys appended to train.sh
        extra = shlex.split(script[-1])[len(shlex.split(run[-1])) :]
        assert all(re.match(r"^[a-z_]+\.[a-z_.]+=\S+$", key) for key in extra), extra


def test_services_answer_to_the_job_group_names_the_run_exports():
    urls = exported_urls("\n".join(node_script("trainer-0")), group=GROUP)
    names = [url for value in urls.values() for url in value.split(",")]
    assert len(names) == 4  # data, reward and the YAML's two retrieval replicas
    for url in names:
        host, port = re.match(r"^http://([a-z0-9.-]+):(\d+)$", url).groups()
        owners = [
            name
            for name, service in SERVICES.items()
            if f"{host.rsplit('.', 1)[0]}.${{JOBGROUP_NAME:-{GROUP}}}"
            in service.get("networks", {}).get("group", {}).get("aliases", [])
        ]
        assert len(owners) == 1, f"{host}: no service (or several) answers to it"
        listens = SERVICES[owners[0]]["command"]
        assert port in " ".join(listens) or SERVICES[owners[0]]["environment"].get("RETRIEVAL_PORT") == port
    assert SERVICES["retrieval-server-1"]["profiles"] == ["search"]  # only with USE_RETRIEVAL


def test_node_ranks_ips_and_the_shared_checkpoint_volume():
    ips = [with_defaults(SERVICES[node]["networks"]["group"]["ipv4_address"]) for node in NODES]
    subnet = with_defaults(COMPOSE["networks"]["group"]["ipam"]["config"][0]["subnet"])
    for node in NODES:
        env = env_of(node)
        assert env["SKYPILOT_NODE_IPS"].split("\n") == ips  # the head (rank 0) first, as SkyPilot lists them
        assert env["SKYPILOT_NODE_RANK"] == str(NODES.index(node))
        assert int(env["SKYPILOT_NUM_NODES"]) == len(NODES)
        assert env["SKYPILOT_JOBGROUP_NAME"] == GROUP
        # CPU ranks: Ray holds one CPU bundle per node so placement puts a rank on each node
        assert env["SKYPILOT_NUM_GPUS_PER_NODE"] == "0" and env["GPUS_PER_NODE"] == env["RAY_NUM_CPUS"] == "1"
        assert f"checkpoints:{env['CHECKPOINT_DIR']}" in SERVICES[node]["volumes"]
    assert all(ip.rsplit(".", 1)[0] == subnet.rsplit(".", 1)[0] for ip in ips)


def test_images_are_built_as_the_single_host_files_build_them():
    trainer = SINGLE_HOST["services"]["trainer"]
    cpu_trainer = {**trainer["build"], "args": CPU_OVERLAY["trainer"]["build"]["args"]}
    expected = {
        "data-server": SINGLE_HOST["services"]["data-server"],
        "reward-server": SINGLE_HOST["services"]["reward-server"],
        "retrieval-server": SINGLE_HOST["services"]["retrieval-server"],
        "retrieval-server-1": SINGLE_HOST["services"]["retrieval-server"],
    }
    for name, single in expected.items():
        assert SERVICES[name]["build"] == single["build"], name
        assert SERVICES[name]["image"] == single["image"], name
    for node in NODES:
        assert SERVICES[node]["build"] == cpu_trainer
        assert SERVICES[node]["image"] == CPU_OVERLAY["trainer"]["image"]


# ------------------------------------------------------------------ the group run (marker docker)

STEPS, BATCH = 4, 4
STEP = r"(?:^|\s)step:{} - "  # the console logger's line of a finished step


class LogWatch:
    """`docker logs --follow` of one container, read in a thread: lines with their arrival time, and
    actions run the moment a line matches (a kill must land inside a step of a few seconds)."""

    def __init__(self, container: str, since: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self.actions: list[tuple[re.Pattern, callable]] = []
        self.changed = threading.Condition()
        argv = ["docker", "logs", "--follow", "--since", f"{since:.3f}", container]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def on(self, pattern: str, action) -> None:
        self.actions.append((re.compile(pattern), action))

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.monotonic()
            for pattern, action in list(self.actions):
                if pattern.search(line):
                    self.actions.remove((pattern, action))
                    action()
            with self.changed:
                self.lines.append((now, line.rstrip("\n")))
                self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> tuple[float, str]:
        """The first line matching `pattern` (seen so far or to come) and when it arrived."""
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        with self.changed:
            while True:
                found = next(((t, line) for t, line in self.lines if regex.search(line)), None)
                if found:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    tail = "\n".join(line for _, line in self.lines[-40:])
                    raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s:\n{tail}")
                self.changed.wait(min(left, 1.0))

    def text(self) -> str:
        with self.changed:
            return "\n".join(line for _, line in self.lines)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@dataclass
class Group:
    """This run's compose project: its environment and the times of each phase."""

    project: str
    env: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        argv = ["docker", "compose", "-p", self.project, "-f", COMPOSE_FILE, *args]
        done = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{shlex.join(argv[3:])} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return done

    def timed(self, label: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        start = time.monotonic()
        try:
            return self.compose(*args, timeout=timeout)
        finally:
            self.timings[label] = time.monotonic() - start

    def container(self, service: str) -> str:
        return self.compose("ps", "--all", "--quiet", service).stdout.strip()

    def url(self, service: str, port: int) -> str:
        return "http://" + self.compose("port", service, str(port)).stdout.strip()

    def watch(self, service: str, since: float) -> LogWatch:
        return LogWatch(self.container(service), since)

    def exit_code(self, service: str) -> int:
        done = subprocess.run(
            ["docker", "inspect", "--format", "{{.State.ExitCode}}", self.container(service)],
            capture_output=True,
            text=True,
        )
        return int(done.stdout.strip())

    def wait_exit(self, service: str, timeout: float) -> int:
        self.compose("wait", service, timeout=timeout, check=False)
        return self.exit_code(service)

    def read(self, service: str, path: str, into: Path) -> Path:
        """A file or folder of `service`'s container (running or stopped), copied to the host."""
        self.compose("cp", f"{service}:{path}", str(into))
        return into


def docker_ready() -> str | None:
    """None when an engine with compose runs (started as CI starts it: test_compose.start_docker)."""
    why_not = start_docker()
    if why_not is None:
        return None
    done = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60, check=False)
    engine = subprocess.run(["docker", "info"], capture_output=True, timeout=60, check=False)
    return None if done.returncode == engine.returncode == 0 else why_not


def ranks_by_node(dashboard: str) -> dict[str, int]:
    """The trainer's live rank actors per node IP, from the Ray dashboard's state API."""
    actors = httpx.get(
        dashboard + "/api/v0/actors",
        params={
            "detail": 1,
            "limit": 1000,
            "filter_keys": "class_name",
            "filter_predicates": "=",
            "filter_values": "RankActor",
        },
        timeout=30,
    ).json()["data"]["result"]["result"]
    nodes = httpx.get(dashboard + "/api/v0/nodes", params={"detail": 1}, timeout=30).json()
    ip_of = {node["node_id"]: node["node_ip"] for node in nodes["data"]["result"]["result"]}
    counts: dict[str, int] = {}
    for actor in actors:
        if actor["state"] == "ALIVE":
            counts[ip_of[actor["node_id"]]] = counts.get(ip_of[actor["node_id"]], 0) + 1
    return counts


def job_group_urls() -> dict[str, str]:
    """{service: URL} by the job-group names the trainer's run exports (one replica each)."""
    urls = exported_urls("\n".join(node_script("trainer-0")), group=GROUP)
    return {
        "data-server": urls["DATA_SERVER_URL"],
        "reward-server": urls["REWARD_SERVER_URL"],
        "retrieval-server": urls["RETRIEVAL_SERVER_URL"].split(",")[0],  # -1 is the search profile's
    }


def served_uids(data_url: str, dataset: str, steps: int, batch_size: int) -> list[list[str]]:
    """What the data-server hands out step by step, walking its cursor from the start."""
    batches, cursor = [], None
    for _ in range(steps):
        body = httpx.post(
            data_url + "/v1/batches",
            json={"dataset": dataset, "batch_size": batch_size, "cursor": cursor},
            timeout=30,
        ).json()
        batches.append([item["uid"] for item in body["items"]])
        cursor = body["next_cursor"]
    return batches


def trained_uids(rollouts: Path, steps: int) -> list[list[str]]:
    """The prompts of each step's rollout dump (trainer.rollout_data_dir), in order, once each."""
    return [
        list(
            dict.fromkeys(
                json.loads(line)["uid"] for line in (rollouts / f"{step}.jsonl").read_text().splitlines()
            )
        )
        for step in range(1, steps + 1)
    ]


def step_time(log: LogWatch, step: int, timeout: float = 300) -> float:
    return log.wait_for(STEP.format(step), timeout)[0]


@pytest.fixture(scope="module")
def group(request, tmp_path_factory):
    why_not = docker_ready()
    if why_not:
        pytest.skip(f"no Docker engine can be started here: {why_not}")
    tmp = tmp_path_factory.mktemp("multinode")
    from testing.tiny import make_tiny_model

    # larger than test_compose's: a step of a few seconds, so that a kill lands inside step 3
    model = make_tiny_model(tmp / "model", hidden=256, layers=4, heads=4, kv_heads=2, tokenizer="char")
    # the default lr (5e-3, for the 32-wide tiny model) leaves this wider one half taught (loss 0.17,
    # tags scrambled); 1e-3 takes the loss to 0.008 in the same 100 steps (~45 s here)
    teach_search_format(model, [short_search_row(i) for i in range(6)], lr=1e-3)
    questions = write_search_rows(tmp / "search", train=range(6, 6 + STEPS * BATCH), test=range(4))
    env = {
        **os.environ,
        "GSM8K_DIR": str(gsm8k_folder(tmp)),
        "SEARCH_DATA_DIR": str(questions),
        "DATASETS": "gsm8k=/data/gsm8k search=/data/search",
        "DATASET": "search",
        "USE_RETRIEVAL": "true",
        "COMPOSE_PROFILES": "search",  # the second retrieval replica, which the trainer then waits for
        # the search results as the model was taught them (testing/search.py)
        "MAX_TOOL_RESPONSE_LENGTH": str(SEARCH_RESULT_TOKENS),
        "TOOL_RESPONSE_TRUNCATE_SIDE": "left",
        "RETRIEVAL_CORPUS_FILE": str(write_corpus(tmp / "corpus.jsonl")),
        "MODEL_DIR": str(model),
        "TORCH_INDEX": stage_cpu_torch(),
        "MULTINODE_NET": f"10.213.{os.getpid() % 250}",  # a /24 of this run's own
        "TOTAL_STEPS": str(STEPS),
        "TRAIN_BATCH_SIZE": str(BATCH),
        "PPO_MINI_BATCH_SIZE": str(BATCH),
        "SAVE_FREQ": "2",
        "MAX_RESPONSE_LENGTH": "256",
    }
    run = Group(f"rljg-multinode-{os.getpid()}", env)
    report = request.config.pluginmanager.get_plugin("terminalreporter")
    try:
        yield run
    finally:
        run.timed("down", "down", "--volumes", "--remove-orphans", timeout=300)
        release_disk()
        with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
            report.write_line("")
            for label, seconds in run.timings.items():
                report.write_line(f"docker compose multinode: {label} {seconds:.1f} s")
            for note in run.notes:
                report.write_line(f"docker compose multinode: {note}")


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_node_run_loses_a_node_and_resumes_without_losing_a_prompt(group, tmp_path, request):
    timings = group.timings
    if not request.config.stash.get(IMAGES_BUILT, False):  # run alone: build (test_compose's images)
        group.timed("build", "build", timeout=2400)
    start = time.time()
    group.timed("up (6 containers)", "up", "--detach", "--no-build", timeout=900)
    trainer = group.watch("trainer-0", since=start)
    node1 = group.container("trainer-1")
    killed: dict[str, float] = {}

    def kill_node1() -> None:
        killed["at"] = time.monotonic()
        subprocess.run(["docker", "kill", node1], capture_output=True, timeout=60)

    # the loop logs a step's row, then checkpoints it and logs the save's time: once that line is out,
    # step 3 starts at once, and node 1 dies in it
    trainer.on(STEP.format(2) + r".*timing_s/save_checkpoint", kill_node1)
    up_done = time.monotonic()
    formed = trainer.wait_for(r"Ray cluster ready: 2/2 nodes", 600)[0]
    timings["Ray cluster of 2 nodes formed (after up)"] = formed - up_done
    # the job-group names, from the worker node: every service, the retrieval-server included
    names = [f"{name}={url}" for name, url in job_group_urls().items()]
    probe = group.compose("exec", "-T", "trainer-1", "bash", "jobgroup/scripts/wait_for_services.sh", *names)
    assert probe.stdout.count("healthy: ") == len(names), probe.stdout
    first = step_time(trainer, 1, 600)
    timings["trainer start to step 1 (services, Ray join, ranks, step 1)"] = first - formed
    # from the Ray cluster itself: one rank process on each node (the policy and the reference in it)
    dashboard = group.url("trainer-0", 8280)
    ips = env_of("trainer-0")["SKYPILOT_NODE_IPS"].replace("10.213.25", group.env["MULTINODE_NET"])
    assert ranks_by_node(dashboard) == dict.fromkeys(ips.split("\n"), 1)
    timings["step 2"] = step_time(trainer, 2) - first

    # node 1 lost in step 3: the run ends, naming it, within the health-check bound (start_ray.sh)
    code = group.wait_exit("trainer-0", timeout=300)
    log = trainer.text()
    error = trainer.wait_for(r"^error: ", 1)
    timings["node loss detected (kill to the error)"] = error[0] - killed["at"]
    assert code != 0 and group.exit_code("trainer-1") == 137, log[-4000:]
    assert timings["node loss detected (kill to the error)"] < 60
    node1_ip = ips.split("\n")[1]
    assert re.search(rf"node {re.escape(node1_ip)} \(trainer-1\)", error[1]), error[1]
    assert "(step 3)" in error[1] and "global_step_2" in error[1], error[1]
    group.notes.append(error[1])
    assert not re.search(STEP.format(3), log)
    trainer.stop()

    # the last complete checkpoint: step 2, with the shards both ranks wrote from their own nodes
    root = "/checkpoints/rl-jobgroup/grpo-multinode"
    kept = group.read("trainer-0", root, tmp_path / "ckpt")
    assert (kept / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in kept.glob("global_step_*")) == ["global_step_2"]
    shards = sorted(p.name for p in (kept / "global_step_2" / "actor").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert json.loads((kept / "global_step_2" / "trainer_state.json").read_text())["step"] == 2

    # `sky jobs` recovery: the whole trainer task again; the reward-server is killed in the resumed
    # step 3 and comes back once the trainer has retried, as one machine's run rides out an outage
    start = time.time()
    restarted = time.monotonic()
    group.compose("up", "--detach", "--no-build", "--no-recreate", *NODES, timeout=600)
    trainer = group.watch("trainer-0", since=start)
    reward = group.container("reward-server")
    trainer.on(r"^resumed from ", lambda: subprocess.run(["docker", "kill", reward], capture_output=True))
    resumed = trainer.wait_for(r"^resumed from ", 600)
    timings["restart to resumed (Ray cluster again, ranks load step 2)"] = resumed[0] - restarted
    assert "global_step_2 (step 2)" in resumed[1], resumed[1]
    retried = trainer.wait_for(r"^retrying", 300)[0]
    group.compose("start", "reward-server", timeout=300)
    third = step_time(trainer, 3)
    timings["step 3 with the reward-server down then back"] = third - retried
    code = group.wait_exit("trainer-0", timeout=600)
    log = trainer.text()
    assert code == 0, log[-4000:]
    timings["resume to the end (steps 3 and 4)"] = time.monotonic() - resumed[0]
    assert re.search(STEP.format(3) + r".*reward/errors:0(?![.\d])", log), log[-3000:]
    assert re.search(STEP.format(4), log) and not re.search(STEP.format(5), log)

    # every prompt once, in the data-server's order: what an uninterrupted run trains on
    rollouts = group.read("trainer-0", "/checkpoints/rollouts/grpo-multinode", tmp_path / "rollouts")
    expected = served_uids(group.url("data-server", 8000), "search", STEPS, BATCH)
    assert trained_uids(rollouts, STEPS) == expected
    # Search-R1 across the nodes: every step's trajectories searched both retrieval replicas' index
    for step in range(1, STEPS + 1):
        responses = [
            json.loads(line)["response"] for line in (rollouts / f"{step}.jsonl").read_text().splitlines()
        ]
        assert any("<information>Doc 1(Title: " in r for r in responses), responses[:2]
    calls = [float(c) for c in re.findall(r"(?:^|\s)step:\d+ - .*?tool_calls/mean:([\d.]+)", log, re.M)]
    assert len(calls) >= 2 and all(c > 0 for c in calls), calls
    group.notes.append(f"tool_calls/mean of the resumed steps 3-4: {calls}")
