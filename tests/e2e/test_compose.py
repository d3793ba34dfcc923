"""docker/compose.yaml and its Dockerfiles, checked for consistency without a Docker engine.

Ports agree across each service's command, port mapping, healthcheck and the trainer's URLs; the
trainer waits for every service it calls to be healthy; every Dockerfile, COPY source, build arg,
module and script exists; the healthcheck command really tells a live service from a dead port.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from services.data_server.sources import parse_spec
from tests.e2e.test_jobgroup_yaml import (
    check_module_call,
    module_calls,
    scripts_called,
    train_sh_argv,
    trainer_dry_run,
)
from tests.helpers import ROOT, SHARED_DATA, free_port, small_data_server

DOCKER = ROOT / "docker"
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
TRAINER = "trainer"
URL = re.compile(r"^http://([a-z0-9-]+):(\d+)$")


def command_text(service: dict) -> str:
    command = service.get("command", [])
    return command if isinstance(command, str) else shlex.join(command)


def container_port(name: str) -> int:
    """The port a service listens on, from its command line or its *_PORT variable."""
    service = SERVICES[name]
    match = re.search(r"--port (\d+)", command_text(service))
    if match:
        return int(match.group(1))
    ports = [int(v) for k, v in service.get("environment", {}).items() if k.endswith("_PORT")]
    assert len(ports) == 1, f"{name}: no port in its command or environment"
    return ports[0]


def with_defaults(value: str) -> str:
    """What compose makes of ${VAR:-default} when VAR is unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def dockerfile_of(service: dict):
    context = (DOCKER / service["build"]["context"]).resolve()
    return context, context / service["build"]["dockerfile"]


def copy_sources(dockerfile_text: str, args: dict[str, str]) -> list[str]:
    """COPY sources from the build context, with ${ARG} filled in from the build args and ARG defaults."""
    values = dict(re.findall(r"^ARG (\w+)=(\S*)", dockerfile_text, re.MULTILINE)) | args
    sources = []
    for line in dockerfile_text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            sources += [s for s in line.split()[1:-1] if not s.startswith("--")]
    return [re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], s) for s in sources]


def test_the_four_services():
    assert set(SERVICES) == {"data-server", "reward-server", "retrieval-server", "code-executor", TRAINER}
    assert SERVICES["code-executor"]["profiles"] == ["code"]  # optional: only with `--profile code`


@pytest.mark.parametrize("name", sorted(set(SERVICES) - {TRAINER}))
def test_port_agrees_across_command_mapping_and_healthcheck(name):
    service, port = SERVICES[name], container_port(name)
    assert any(str(mapping).split(":")[-1] == str(port) for mapping in service["ports"]), service["ports"]
    probe = " ".join(service["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/health" in probe
    assert service["healthcheck"]["test"][0] == "CMD"


def test_trainer_urls_match_services_ports_and_wait_for_health():
    trainer = SERVICES[TRAINER]
    urls = {k: v for k, v in trainer["environment"].items() if k.endswith("_URL")}
    assert set(urls) == {"DATA_SERVER_URL", "REWARD_SERVER_URL", "RETRIEVAL_SERVER_URL", "CODE_EXECUTOR_URL"}
    for var, url in urls.items():
        host, port = URL.match(url).groups()
        assert var == host.upper().replace("-", "_") + "_URL"  # DATA_SERVER_URL -> data-server
        assert host in SERVICES and int(port) == container_port(host), url
        optional = "profiles" in SERVICES[host]  # waited for when its profile is on, else left out
        expected = {"condition": "service_healthy", **({"required": False} if optional else {})}
        if host == "retrieval-server":  # called only with USE_RETRIEVAL: the command waits for it then
            expected = {"condition": "service_started"}
        assert trainer["depends_on"][host] == expected
        assert "healthcheck" in SERVICES[host]
    assert set(trainer["depends_on"]) == set(SERVICES) - {TRAINER}


@pytest.mark.parametrize("flag", ["false", "true"])
def test_use_code_executor_wires_the_code_executor_to_the_reward_server_and_the_trainer(flag):
    """USE_CODE_EXECUTOR (with `--profile code`): the reward-server's command gets --code-executor-url
    and the trainer's train.sh the code tool, both at the code-executor's service name and port."""
    reward = SERVICES["reward-server"]
    env = {k: with_defaults(v) for k, v in reward["environment"].items()}
    done = subprocess.run(
        command_text(reward).split(),
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], **env, "USE_CODE_EXECUTOR": flag, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    argv = done.stdout.split()
    assert argv[2:5] == ["services.reward_server", "--port", str(container_port("reward-server"))]
    trainer_env = {k: with_defaults(v) for k, v in SERVICES[TRAINER]["environment"].items()}
    keys = dict(a.split("=", 1) for a in train_sh_argv({**trainer_env, "USE_CODE_EXECUTOR": flag})[3:])
    tool_config = keys.get("actor_rollout_ref.rollout.multi_turn.tool_config_path")
    if flag == "true":
        url = argv[argv.index("--code-executor-url") + 1]
        assert (
            url
            == trainer_env["CODE_EXECUTOR_URL"]
            == f"http://code-executor:{container_port('code-executor')}"
        )
        assert tool_config == "jobgroup/tools/code_tool_config.yaml"  # reads CODE_EXECUTOR_URL itself
        assert keys["actor_rollout_ref.rollout.multi_turn.format"] == "hermes"
        trainer_dry_run(list(f"{k}={v}" for k, v in keys.items()))
    else:
        assert "--code-executor-url" not in argv and tool_config is None


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_dockerfiles_copy_sources_and_build_args_exist(name):
    service = SERVICES[name]
    context, dockerfile = dockerfile_of(service)
    assert context == ROOT and dockerfile.is_file(), dockerfile
    text = dockerfile.read_text()
    for source in copy_sources(text, service["build"].get("args", {})):
        assert (context / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
    declared = set(re.findall(r"^ARG (\w+)", text, re.MULTILINE))
    assert set(service["build"].get("args", {})) <= declared


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_commands_name_modules_and_scripts_that_exist(name):
    text = command_text(SERVICES[name])
    for script in scripts_called(text):
        assert (ROOT / script).is_file(), script
    calls = module_calls(text, f"compose/{name}")
    for script in scripts_called(text):
        calls += module_calls((ROOT / script).read_text(), f"compose/{name} -> {script}")
    assert calls, f"{name} runs no python module"
    for call in calls:
        check_module_call(call)


def locked(lock: str) -> dict[str, str]:
    """docker/locks/LOCK.txt as {normalised name: version}."""
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (DOCKER / "locks" / f"{lock}.txt").read_text(), re.M)
    return {canonicalize_name(name): version for name, version in pins}


def test_services_image_for_data_and_reward_has_no_torch():
    for name in ("data-server", "reward-server"):
        assert SERVICES[name]["build"]["args"]["LOCK"] == "services"
    assert not set(locked("services")) & {"torch", "sentence-transformers", "transformers"}
    assert SERVICES["retrieval-server"]["build"]["args"]["LOCK"] == "retrieval"


def run_healthcheck(test: list[str], port: int) -> int:
    argv = [a.replace(re.search(r":(\d+)/health", " ".join(test)).group(1), str(port)) for a in test[1:]]
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    return subprocess.run(argv, check=False, capture_output=True, timeout=30).returncode


def test_healthcheck_command_tells_a_live_service_from_a_dead_port():
    test = SERVICES["data-server"]["healthcheck"]["test"]
    with small_data_server() as (url, _):
        assert run_healthcheck(test, int(url.rsplit(":", 1)[1])) == 0
    assert run_healthcheck(test, free_port()) != 0


def interpolated(value, shell: dict[str, str]) -> str:
    """What compose makes of ${VAR:-default} / ${VAR} with `shell` as the caller's environment."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: shell.get(m[1]) or m[2] or "", str(value))


def command_run(name: str, shell: dict[str, str], path: Path | None = None) -> subprocess.CompletedProcess:
    """Run a service's command here as its container would (compose's $$ is a $), with its environment
    as compose fills it in from `shell`; `path` goes first on PATH (a stand-in `python`)."""
    service = SERVICES[name]
    env = {k: interpolated(v, shell) for k, v in service.get("environment", {}).items()}
    search = f"{path}:{os.environ['PATH']}" if path else os.environ["PATH"]
    argv = [word.replace("$$", "$") for word in service["command"]]
    return subprocess.run(
        argv, cwd=ROOT, env={"PATH": search, **env, "DRY_RUN": "1"}, capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip


def run_command(name: str, shell: dict[str, str], path: Path | None = None) -> list[str]:
    """command_run, which must succeed: its stdout lines."""
    done = command_run(name, shell, path)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def trainer_stand_ins(tmp_path: Path, *, gpus: int | None = None, down: tuple[str, ...] = ()) -> Path:
    """A fresh folder to put first on the trainer command's PATH: `curl` (what wait_for_services.sh probes
    /health with) answers 200, or connection refused for the services named in `down`, and notes each URL
    in curl.log; `python` answers torch.cuda.device_count() with `gpus` (None: it fails, as without torch
    or a driver) and refuses anything else (train.sh's DRY_RUN only prints its python command)."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    refused = "".join(f"  http://{name}:*) exit 7 ;;\n" for name in down)
    curl = f"""#!/bin/sh
for url; do :; done
echo "$url" >>"{folder}/curl.log"
case $url in
{refused}esac
printf 200
"""
    answer = "exit 1" if gpus is None else f"echo {gpus}"
    python = f"""#!/bin/sh
case "$*" in *torch.cuda.device_count*) {answer} ;; *) echo "unexpected: python $*" >&2; exit 3 ;; esac
"""
    for name, text in (("curl", curl), ("python", python)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


@dataclass
class TrainerRun:
    """The trainer's command as compose runs it, with train.sh's DRY_RUN."""

    returncode: int
    log: list[str]  # what it printed before train.sh's command (the health wait, the GPU count)
    keys: dict[str, str]  # train.sh's main_ppo keys; empty when it never got there
    probed: dict[str, str]  # {service: URL} of every /health the wait asked for
    stderr: str


def run_trainer(shell: dict[str, str], tmp_path: Path, **stand_ins) -> TrainerRun:
    folder = trainer_stand_ins(tmp_path, **stand_ins)
    done = command_run(TRAINER, shell, path=folder)
    lines = done.stdout.splitlines()
    start = next(
        (i for i in range(len(lines)) if lines[i : i + 3] == ["python", "-m", "trainer.main_ppo"]), None
    )
    log = lines if start is None else lines[:start]
    keys = {} if start is None else dict(a.split("=", 1) for a in lines[start + 3 :])
    urls = (folder / "curl.log").read_text().split() if (folder / "curl.log").exists() else []
    probed = {URL.match(url.removesuffix("/health"))[1]: url.removesuffix("/health") for url in urls}
    return TrainerRun(done.returncode, log, keys, probed, done.stderr)


def trainer_keys(shell: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The trainer's main_ppo keys (train.sh's DRY_RUN) as compose runs it with `shell`'s variables."""
    run = run_trainer(shell, tmp_path)
    assert run.returncode == 0 and run.keys, (run.log, run.stderr)
    return run.keys


def data_server_argv(shell: dict[str, str], tmp_path: Path) -> list[str]:
    """The data-server's arguments as compose runs it with `shell`'s variables (a stand-in python)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    argv = run_command("data-server", shell, path=tmp_path)
    assert argv[:4] == ["-m", "services.data_server", "--port", "8000"], argv
    return argv


def data_server_datasets(shell: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """{name: source} of the data-server's --datasets as compose runs it with `shell`'s variables."""
    argv = data_server_argv(shell, tmp_path)
    specs = argv[argv.index("--datasets") + 1 :]
    specs = specs[: next((i for i, arg in enumerate(specs) if arg.startswith("--")), len(specs))]
    return dict(parse_spec(spec) for spec in specs)


@pytest.mark.parametrize(
    "shell",
    [
        {},
        {"USE_RETRIEVAL": "true"},
        {"USE_CODE_EXECUTOR": "true"},
        {"USE_RETRIEVAL": "true", "USE_CODE_EXECUTOR": "true"},
        {"USE_RETRIEVAL": "true", "TOOL_FORMAT": "hermes"},
    ],
    ids=["no-tools", "search", "code", "both", "search-hermes"],
)
def test_qa_prompts_teach_the_tool_format_the_trainer_parses(shell, tmp_path):
    """The data-server's QA prompts follow the trainer's tool format (jobgroup/scripts/tool_format.sh):
    Search-R1's <search> tags for search_r1, the tools the chat template shows for hermes (the code tool
    makes it hermes). Before, USE_CODE_EXECUTOR trained hermes on prompts that taught <search> tags, so
    the search tool was never called."""
    argv = data_server_argv(shell, tmp_path)
    qa_instruction = argv[argv.index("--qa-instruction") + 1]
    keys = trainer_keys(shell, tmp_path)
    trained_format = keys.get("actor_rollout_ref.rollout.multi_turn.format", "search_r1")
    assert qa_instruction == ("tools" if trained_format == "hermes" else "search_r1"), (keys, argv)
    assert (trained_format == "hermes") == ("USE_CODE_EXECUTOR" in shell or "TOOL_FORMAT" in shell)


YAML_TASKS = {
    doc["name"]: doc
    for doc in yaml.safe_load_all((ROOT / "jobgroup" / "verl-grpo.yaml").read_text())
    if doc and "envs" in doc
}


@pytest.mark.parametrize("flag", ["false", "true"])
def test_use_retrieval_trains_on_the_qa_set_the_data_server_serves_as_the_yaml_does(flag, tmp_path):
    """USE_RETRIEVAL=true is verl-grpo.yaml's search run: the data-server serves Search-R1's QA set under
    the YAML's name and source, and the trainer trains on it with the search tool and the YAML's search
    settings. Unset or false: GSM8K and the synthetic sums, training on GSM8K, as before."""
    shell = {"USE_RETRIEVAL": flag} if flag == "true" else {}
    served = data_server_datasets(shell, tmp_path)
    keys = trainer_keys(shell, tmp_path)
    assert keys["data.source"] == "server" and keys["data.dataset"] in served, (keys["data.dataset"], served)
    if flag == "false":
        assert served == {"gsm8k": "hub:openai/gsm8k", "synthetic-arith": "synthetic-arith:easy"}
        assert keys["data.dataset"] == "gsm8k" and not any("multi_turn" in key for key in keys)
        assert keys["data.max_response_length"] == "1024" and keys["trainer.test_freq"] == "10"
        return
    yaml_trainer = YAML_TASKS["verl-trainer"]["envs"]
    yaml_served = dict(parse_spec(s) for s in YAML_TASKS["data-server"]["envs"]["DATASETS"].split())
    dataset = yaml_trainer["DATASET"]
    assert keys["data.dataset"] == dataset and served[dataset] == yaml_served[dataset]
    assert served["gsm8k"] == "hub:openai/gsm8k"  # the default list stays served too
    assert (
        keys["actor_rollout_ref.rollout.multi_turn.tool_config_path"]
        == "jobgroup/tools/search_tool_config.yaml"
    )
    assert keys["actor_rollout_ref.rollout.multi_turn.format"] == "search_r1"
    assert keys["services.retrieval_url"] == f"'http://retrieval-server:{container_port('retrieval-server')}'"
    assert keys["data.max_response_length"] == str(yaml_trainer["MAX_RESPONSE_LENGTH"])
    assert keys["trainer.test_freq"] == str(yaml_trainer["TEST_FREQ"])
    assert keys["trainer.val_before_train"] == "False" == str(yaml_trainer["VAL_BEFORE_TRAIN"]).capitalize()
    # what the caller sets still wins: another dataset the data-server is told to serve
    own = {**shell, "DATASET": "mine", "DATASETS": "mine=/data/mine", "TEST_FREQ": "5"}
    assert data_server_datasets(own, tmp_path) == {"mine": "/data/mine"}
    mine = trainer_keys(own, tmp_path)
    assert mine["data.dataset"] == "mine" and mine["trainer.test_freq"] == "5"
    trainer_dry_run([f"{k}={v}" for k, v in keys.items()])


def test_trainer_command_with_compose_environment_gives_a_config_the_trainer_accepts(tmp_path):
    trainer = SERVICES[TRAINER]
    assert "jobgroup/scripts/train.sh" in command_text(trainer)
    keys = trainer_keys({}, tmp_path)
    argv = ["python", "-m", "trainer.main_ppo", *(f"{k}={v}" for k, v in keys.items())]
    assert keys["services.data_url"] == "'http://data-server:8000'"  # quoted: Hydra reads a,b as a sweep
    assert "services.retrieval_url" not in keys  # USE_RETRIEVAL defaults to false (the math dataset)
    assert keys["trainer.default_local_dir"].startswith("/checkpoints/")
    assert keys["trainer.logger"] == "['console']"  # WANDB_API_KEY empty by default
    trainer_dry_run(argv[3:])


ALWAYS_WAITED = {"data-server", "reward-server"}


@pytest.mark.parametrize(
    ("shell", "waited"),
    [
        ({}, ALWAYS_WAITED),
        ({"USE_RETRIEVAL": "false"}, ALWAYS_WAITED),
        ({"USE_RETRIEVAL": "true"}, ALWAYS_WAITED | {"retrieval-server"}),
        ({"USE_CODE_EXECUTOR": "true"}, ALWAYS_WAITED | {"code-executor"}),
    ],
    ids=["unset", "false", "use-retrieval", "use-code-executor"],
)
def test_trainer_waits_for_the_retrieval_server_only_with_use_retrieval(shell, waited, tmp_path):
    """As jobgroup/verl-grpo.yaml's trainer: compose starts the trainer once the data- and reward-servers
    are healthy and the retrieval-server has started; the command then waits (wait_for_services.sh) for
    the services the run calls, the retrieval-server only with USE_RETRIEVAL (its first start builds the
    index: up to 30 minutes, for nothing when the run does not search), then runs train.sh."""
    depends_on = SERVICES[TRAINER]["depends_on"]
    assert depends_on["retrieval-server"] == {"condition": "service_started"}  # it starts either way
    assert {depends_on[name]["condition"] for name in ALWAYS_WAITED} == {"service_healthy"}
    env = {k: interpolated(v, shell) for k, v in SERVICES[TRAINER]["environment"].items()}
    run = run_trainer(shell, tmp_path)
    assert run.returncode == 0 and run.keys, (run.log, run.stderr)
    assert run.probed == {name: env[f"{name.upper().replace('-', '_')}_URL"] for name in waited}
    assert f"healthy: {sorted(waited)[0]} " in "\n".join(run.log)  # wait_for_services.sh's own lines
    # a retrieval-server still building its index (or down): the run without search trains regardless
    down = run_trainer({**shell, "SERVICE_WAIT_TIMEOUT_S": "0"}, tmp_path, down=("retrieval-server",))
    if "retrieval-server" in waited:
        assert down.returncode == 1 and not down.keys
        assert "service retrieval-server never became healthy" in down.stderr, down.stderr
    else:
        assert down.returncode == 0 and down.keys == run.keys, (down.log, down.stderr)
        assert "services.retrieval_url" not in down.keys


@pytest.mark.parametrize(
    ("gpus", "shell", "expected"),
    [
        (None, {}, 1),  # torch cannot tell (no driver): one
        (0, {}, 1),
        (1, {}, 1),
        (4, {}, 4),
        (8, {}, 8),
        (8, {"GPUS_PER_NODE": "2"}, 2),  # the caller's GPUS_PER_NODE wins
        (8, {"GPUS_PER_NODE": "8", "USE_RETRIEVAL": "true"}, 8),
    ],
    ids=["no-torch", "0", "1", "4", "8", "8-set-2", "8-set-8-search"],
)
def test_trainer_trains_on_every_gpu_its_container_sees(gpus, shell, expected, tmp_path):
    """deploy reserves every GPU of the host for the trainer: train.sh gets GPUS_PER_NODE = the GPUs torch
    sees in the container (stand-in: `python` answering torch.cuda.device_count()), unless the caller sets
    it. More than one trains through the local Ray cluster the trainer starts itself: no RAY_ADDRESS and
    no start_ray.sh here (trainer/parallel/placement.py's connect_ray)."""
    assert SERVICES[TRAINER]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    run = run_trainer(shell, tmp_path, gpus=gpus)
    assert run.returncode == 0, (run.log, run.stderr)
    assert run.keys["trainer.n_gpus_per_node"] == str(expected) and run.keys["trainer.nnodes"] == "1"
    if "GPUS_PER_NODE" not in shell:
        assert f"GPUS_PER_NODE={expected}: the GPUs this container sees" in run.log
    assert "RAY_ADDRESS" not in SERVICES[TRAINER]["environment"] and "start_ray.sh" not in command_text(
        SERVICES[TRAINER]
    )
    if gpus == 8 and not shell:  # compose's batch sizes split evenly over 8 GPUs: the trainer accepts it
        trainer_dry_run([f"{k}={v}" for k, v in run.keys.items()])


def test_cpu_overlay_trainer_still_starts_once_every_service_is_healthy():
    """compose.cpu.yaml's trainer has its own command (it waits for all three services, the retrieval-server
    included, then trains on CPU): it keeps compose.yaml's former `service_healthy` on all three, so its run
    (and the docker tests on it) still starts after the retrieval-server's index is built."""
    merged = SERVICES[TRAINER]["depends_on"] | CPU_OVERLAY[TRAINER].get("depends_on", {})
    assert {name: merged[name]["condition"] for name in PORTS} == dict.fromkeys(PORTS, "service_healthy")
    command = command_text(CPU_OVERLAY[TRAINER])
    for name in PORTS:
        assert f"{name}=$${name.upper().replace('-', '_')}_URL" in command
    assert "GPUS_PER_NODE" not in command and "trainer.device=cpu" in command  # one CPU rank, as before


START_RAY = (ROOT / "jobgroup" / "scripts" / "start_ray.sh").read_text()
RAY_DASHBOARD = int(re.search(r"dashboard_port=\$\{RAY_DASHBOARD_PORT:-(\d+)\}", START_RAY).group(1))


@pytest.mark.parametrize("file", ["compose.yaml", "compose.multinode.yaml"])
def test_trainers_publish_only_the_ray_dashboard_their_command_starts(file):
    """A trainer container publishes a port only where something in it binds that port: the Ray dashboard
    of jobgroup/scripts/start_ray.sh (RAY_DASHBOARD_PORT, else its default), where its command starts Ray."""
    services = yaml.load((DOCKER / file).read_text(), Loader=ComposeLoader)["services"]
    trainers = {name: s for name, s in services.items() if name.startswith(TRAINER)}
    assert trainers
    for name, service in trainers.items():
        published = {int(str(mapping).rsplit(":", 1)[1]) for mapping in service.get("ports", [])}
        if "start_ray.sh" not in command_text(service):
            assert not published, (
                f"{file}: {name} publishes {published}, but starts no Ray: nothing binds them"
            )
            continue
        env = service.get("environment", {})
        dashboard = (
            int(with_defaults(env["RAY_DASHBOARD_PORT"])) if "RAY_DASHBOARD_PORT" in env else RAY_DASHBOARD
        )
        assert published <= {dashboard}, (
            f"{file}: {name} publishes {published}; Ray's dashboard is {dashboard}"
        )
        assert dashboard == RAY_DASHBOARD  # one dashboard port everywhere: the SkyPilot YAMLs' too


def test_trainer_image_exposes_the_ray_dashboard_port():
    exposed = re.findall(r"^EXPOSE (.+)$", (DOCKER / "Dockerfile.trainer").read_text(), re.MULTILINE)
    assert exposed == [str(RAY_DASHBOARD)]


# ------------------------------------------------------------ locks and the CPU overlay, without an engine

LOCK_SH = DOCKER / "locks" / "lock.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (`!reset`, `!override`), read as {"!tag": value}."""


def _compose_tag(loader: ComposeLoader, suffix: str, node: yaml.Node) -> dict:
    if isinstance(node, yaml.MappingNode):
        value = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)
    return {f"!{suffix}": value}


ComposeLoader.add_multi_constructor("!", _compose_tag)
CPU_OVERLAY = yaml.load((DOCKER / "compose.cpu.yaml").read_text(), Loader=ComposeLoader)["services"]


def lock_sets() -> dict[str, tuple[str, str, list[str]]]:
    """lock.sh's `lock NAME PYTHON TORCH EXTRA...` lines: {name: (python, torch, extras)}."""
    found = re.findall(r"^lock (\S+) (\S+) (\S+) (.+)$", LOCK_SH.read_text(), re.MULTILINE)
    return {name: (python, torch, extras.split()) for name, python, torch, extras in found}


def requirements_of(extras: list[str]) -> list[Requirement]:
    """The project's core dependencies plus those of `extras`, self-references (rl-jobgroup[x]) expanded."""
    project = PYPROJECT["project"]
    todo, seen, found = list(extras), set(), [Requirement(r) for r in project["dependencies"]]
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "rl-jobgroup":
                todo += sorted(req.extras)
            else:
                found.append(req)
    return found


def test_lock_sh_locks_every_lock_that_compose_or_a_dockerfile_names():
    sets = lock_sets()
    assert {
        "services",
        "retrieval",
        "reward-model",
        "reward-model-cpu",
        "trainer-cuda",
        "trainer-cpu",
    } <= set(sets)
    for name in sets:
        assert (DOCKER / "locks" / f"{name}.txt").is_file(), f"run: bash {LOCK_SH.relative_to(ROOT)}"
    named = [s["build"]["args"]["LOCK"] for s in SERVICES.values() if "LOCK" in s["build"].get("args", {})]
    named += [CPU_OVERLAY[TRAINER]["build"]["args"]["LOCK"]]
    for dockerfile in DOCKER.glob("Dockerfile.*"):
        named += re.findall(r"^ARG LOCK=(\S+)", dockerfile.read_text(), re.MULTILINE)
    assert set(named) <= set(sets), set(named) - set(sets)


@pytest.mark.parametrize("lock", sorted(lock_sets()))
def test_lock_satisfies_pyproject(lock):
    """Every dependency of the lock's extras is pinned there at a version pyproject.toml accepts."""
    python, torch_kind, extras = lock_sets()[lock]
    pins = locked(lock)
    environment = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux"}
    for req in requirements_of(extras):
        if req.marker and not req.marker.evaluate(environment):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{lock}: {req} is not locked; run: bash docker/locks/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), f"{lock}: {name}=={pins[name]} vs {req}"
    if torch_kind == "cpu":  # PyTorch's CPU build: no CUDA wheels in the image
        assert pins["torch"].endswith("+cpu") and not [n for n in pins if n.startswith("nvidia-")]
    elif torch_kind == "cuda":
        assert "+" not in pins["torch"] and "nvidia-cudnn-cu12" in pins  # CUDA 12, the base image's
    else:
        assert "torch" not in pins


def test_reward_model_extra_brings_what_the_scorer_imports():
    names = {canonicalize_name(r.name) for r in requirements_of(["reward-model"])}
    assert {"torch", "transformers", "fastapi"} <= names
    assert {"torch", "transformers"} <= set(locked("reward-model")) & set(locked("reward-model-cpu"))


def test_cpu_trainer_is_the_same_dockerfile_with_other_build_args():
    build = CPU_OVERLAY[TRAINER]["build"]
    assert set(build) == {"args"}, "the CPU variant may change build args only"
    declared = set(re.findall(r"^ARG (\w+)", (DOCKER / "Dockerfile.trainer").read_text(), re.MULTILINE))
    assert set(build["args"]) <= declared
    assert build["args"]["BASE_IMAGE"] == "python:3.11-slim" and build["args"]["LOCK"] == "trainer-cpu"
    assert CPU_OVERLAY[TRAINER]["deploy"] == {"!reset": {}}  # no GPU reservation
    for name in set(CPU_OVERLAY) - {TRAINER}:
        assert "build" not in CPU_OVERLAY[name], f"{name}: the overlay must not change how services build"


# ------------------------------------------------------ the images built and the group run (marker docker)
#
# The commands are README's "Docker compose" section: build the images (the CPU trainer variant included),
# `up` the four containers on their compose network, wait for the trainer's 2 GRPO steps, then a health
# check and one real request to each service, and `down`. Host ports are free loopback ones, and the
# compose project name is this run's own, so a developer's group on this machine is left alone.

DOCKER_HERE = ROOT.parent / "shared" / "tools" / "docker_here.sh"
# CI's engine start, overlay2 first and docker_here.sh's vfs engine where that fails, then docker_here.sh
DOCKER_ENGINE = ROOT / ".ci" / "docker_engine.sh"
COMPOSE_FILES = ["-f", "docker/compose.yaml", "-f", "docker/compose.cpu.yaml"]
BUILT = ["data-server", "retrieval-server", TRAINER]  # reward-server runs data-server's image
IMAGES = {
    "services": "rl-jobgroup-services:latest",
    "retrieval": "rl-jobgroup-retrieval:latest",
    "trainer CPU": "rl-jobgroup-trainer-cpu:latest",
}
PORTS = {"data-server": 8000, "reward-server": 8001, "retrieval-server": 8002}
CORPUS_ROWS = 300
# Set once this module has built the images in a session: test_multinode.py then runs them as they are.
IMAGES_BUILT = pytest.StashKey[bool]()


def start_docker() -> str | None:
    """Start a Docker engine and compose as CI does: None once they run, else why they cannot."""
    if not DOCKER_HERE.is_file():
        return f"{DOCKER_HERE} (which installs and starts Docker here) is not there"
    try:
        done = subprocess.run(["bash", str(DOCKER_ENGINE)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return f"{DOCKER_ENGINE.name} did not finish within 900 s"
    if done.returncode != 0:
        return f"{DOCKER_ENGINE.name} failed: {done.stderr.strip()[-500:]}"
    return None


def release_disk() -> None:
    """Drop untagged images, and under the vfs storage driver the build cache too. Under vfs (the engine
    .ci/docker_engine.sh falls back to where overlay mounts fail) every layer is a full copy of the image's
    files, and the build cache holds on to the layers of the images a rebuild untagged: ~4 GB a run with a
    code change, which a reused machine piles up until a container cannot be created (it happened to a CI
    run). The tagged images stay; so does the build cache of a copy-on-write driver (overlay2, CI's
    first choice), where it costs little and saves a rebuild."""
    subprocess.run(["docker", "image", "prune", "--force"], capture_output=True, timeout=600)
    driver = subprocess.run(["docker", "info", "-f", "{{.Driver}}"], capture_output=True, timeout=60)
    if driver.stdout.strip() == b"vfs":
        subprocess.run(["docker", "builder", "prune", "--force"], capture_output=True, timeout=600)


def stage_cpu_torch() -> str:
    """Put PyTorch's CPU wheel in docker/wheels/ where pip finds it; return the TORCH_INDEX to build with."""
    wheels = DOCKER / "wheels"
    if not list(wheels.glob("torch-*+cpu-*.whl")):
        torch_pin = f"torch=={locked('trainer-cpu')['torch']}"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), torch_pin],
            capture_output=True,
            timeout=600,
        )
    # With the wheel at hand the build needs PyPI only; without it, PyTorch's CPU index.
    return "" if list(wheels.glob("torch-*+cpu-*.whl")) else "https://download.pytorch.org/whl/cpu"


def gsm8k_folder(tmp: Path) -> Path:
    """GSM8K from ../shared/data when it is there, else a small synthetic set in GSM8K's format."""
    shared = SHARED_DATA / "gsm8k"
    if (shared / "train.jsonl").is_file():
        return shared
    folder = tmp / "gsm8k"
    folder.mkdir()
    for split, count in (("train", 64), ("test", 8)):
        rows = [
            {"question": f"What is {i} plus {i + 3}?", "answer": f"#### {2 * i + 3}"} for i in range(count)
        ]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def small_corpus(tmp: Path) -> Path:
    """The first CORPUS_ROWS passages of the Search-R1 wiki-18 sample (or SQuAD's, or made-up ones)."""
    rows = []
    for name in ("flashrag_wiki18_sample.jsonl", "squad_dev_corpus.jsonl"):
        path = SHARED_DATA / "wiki" / name
        if path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines()[:CORPUS_ROWS]]
            break
    rows = rows or [
        {"id": str(i), "contents": f'"Topic {i}"\nFacts about topic number {i}.'} for i in range(50)
    ]
    path = tmp / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": r["id"], "contents": r["contents"]}) + "\n" for r in rows))
    return path


@dataclass
class Group:
    """A compose project of this run: its environment, and the trainer's exit code and log once it ended."""

    project: str
    env: dict[str, str]
    corpus: Path
    gsm8k: Path
    timings: dict[str, float] = field(default_factory=dict)
    trainer_exit: int | None = None
    trainer_log: str = ""

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        argv = ["docker", "compose", "-p", self.project, *COMPOSE_FILES, *args]
        done = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            logs = subprocess.run(
                [
                    "docker",
                    "compose",
                    "-p",
                    self.project,
                    *COMPOSE_FILES,
                    "logs",
                    "--no-color",
                    "--tail",
                    "40",
                ],
                cwd=ROOT,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
            raise AssertionError(
                f"{shlex.join(argv[4:])} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}\nlogs:\n{logs[-6000:]}"
            )
        return done

    def timed(self, label: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        start = time.monotonic()
        try:
            return self.compose(*args, timeout=timeout)
        finally:
            self.timings[label] = time.monotonic() - start

    def url(self, service: str) -> str:
        host_port = self.compose("port", service, str(PORTS[service])).stdout.strip()
        return f"http://{host_port}"


def image_size_mb(image: str) -> float:
    done = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", image], capture_output=True)
    return int(done.stdout or 0) / 1e6


@pytest.fixture(scope="module")
def group(request, tmp_path_factory):
    why_not = start_docker()
    if why_not:
        pytest.skip(f"no Docker engine can be started here: {why_not}")
    tmp = tmp_path_factory.mktemp("compose")
    from testing.tiny import make_tiny_model

    model = make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, tokenizer="char")
    loopback = {f"{name.upper().replace('-', '_')}_PUBLISH": "127.0.0.1:" for name in PORTS}
    env = {
        **os.environ,
        **loopback,
        "GSM8K_DIR": str(gsm8k_folder(tmp)),
        "RETRIEVAL_CORPUS_FILE": str(small_corpus(tmp)),
        "MODEL_DIR": str(model),
        "TORCH_INDEX": stage_cpu_torch(),
    }
    run = Group(f"rljg-test-{os.getpid()}", env, Path(env["RETRIEVAL_CORPUS_FILE"]), Path(env["GSM8K_DIR"]))
    report = request.config.pluginmanager.get_plugin("terminalreporter")
    try:
        release_disk()  # what an earlier run left
        run.timed("build (3 images)", "build", *BUILT, timeout=2400)
        request.config.stash[IMAGES_BUILT] = True
        run.timed("up (services healthy, trainer started)", "up", "--detach", "--no-build", timeout=900)
        start = time.monotonic()
        waited = run.compose("wait", TRAINER, timeout=900, check=False)
        run.timings["trainer run (2 GRPO steps)"] = time.monotonic() - start
        # `compose wait` prints the trainer's exit code (and exits with it).
        run.trainer_exit = int(waited.stdout.split()[-1]) if waited.stdout.split() else waited.returncode
        run.trainer_log = run.compose("logs", "--no-color", TRAINER).stdout
        yield run
    finally:
        run.timed("down", "down", "--volumes", "--remove-orphans", timeout=300)
        release_disk()  # the images this run's build replaced
        lines = [f"docker compose: {label} {seconds:.0f} s" for label, seconds in run.timings.items()]
        lines += [f"docker image {label}: {image_size_mb(image):.0f} MB" for label, image in IMAGES.items()]
        # Straight to the terminal, past pytest's output capture, so CI's log shows the times under -q.
        with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
            report.write_line("")
            for line in lines:
                report.write_line(line)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(4000)
def test_trainer_in_its_container_trains_two_steps_reaching_the_services_by_name(group, tmp_path):
    log = group.trainer_log
    assert group.trainer_exit == 0, log[-6000:]
    for name, port in PORTS.items():
        assert f"healthy: {name} http://{name}:{port}" in log, log[-3000:]
    assert "step:1 - " in log and "step:2 - " in log and "step:3 - " not in log, log[-3000:]
    assert re.search(r"step:2 - .*critic/score/mean:", log)
    # The checkpoint volume, read through the stopped trainer container (no new container to start).
    latest = "/checkpoints/rl-jobgroup/grpo-gsm8k/latest_checkpointed_iteration.txt"
    group.compose("cp", f"{TRAINER}:{latest}", str(tmp_path / "latest.txt"))
    assert (tmp_path / "latest.txt").read_text().strip() == "2"


@pytest.mark.docker
@pytest.mark.timeout(300)
def test_each_service_container_is_healthy(group):
    states = [json.loads(line) for line in group.compose("ps", "--format", "json").stdout.splitlines()]
    health = {s["Service"]: s["Health"] for s in states}
    assert {name: health.get(name) for name in PORTS} == dict.fromkeys(PORTS, "healthy"), states
    for name in PORTS:
        assert httpx.get(group.url(name) + "/health", timeout=10).status_code == 200


@pytest.mark.docker
@pytest.mark.timeout(300)
def test_data_server_container_serves_gsm8k_from_the_local_folder(group):
    body = httpx.post(
        group.url("data-server") + "/v1/batches", json={"dataset": "gsm8k", "batch_size": 3}, timeout=30
    ).json()
    questions = {
        json.loads(line)["question"] for line in (group.gsm8k / "train.jsonl").read_text().splitlines()
    }
    assert len(body["items"]) == 3
    for item in body["items"]:
        assert any(q in item["prompt"][-1]["content"] for q in questions), item["prompt"]
        assert item["data_source"] == "openai/gsm8k"


@pytest.mark.docker
@pytest.mark.timeout(300)
def test_reward_server_container_scores_gsm8k(group):
    items = [
        {"data_source": "openai/gsm8k", "response": "6 * 12 = 72. #### 72", "ground_truth": "72"},
        {"data_source": "openai/gsm8k", "response": "I think #### 70", "ground_truth": "72"},
    ]
    body = httpx.post(group.url("reward-server") + "/v1/rewards", json={"items": items}, timeout=30).json()
    assert [r["score"] for r in body["results"]] == [1.0, 0.0]


@pytest.mark.docker
@pytest.mark.timeout(300)
def test_retrieval_server_container_finds_a_passage_of_its_corpus(group):
    passages = [json.loads(line) for line in group.corpus.read_text().splitlines()]
    target = passages[len(passages) // 2]
    query = " ".join(target["contents"].split()[:25])
    body = httpx.post(
        group.url("retrieval-server") + "/retrieve",
        json={"queries": [query], "topk": 3, "return_scores": True},
        timeout=60,
    ).json()
    hits = body["result"][0]
    assert len(hits) == 3 and hits[0]["document"]["id"] == target["id"], hits
    assert hits[0]["score"] >= hits[1]["score"]


def test_readme_shows_the_commands_this_test_runs():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Docker compose") :]
    assert f"docker compose -p rljg-test {' '.join(COMPOSE_FILES)}" in section
    for command in (
        f"build {' '.join(BUILT)}",
        "up --detach --no-build",
        f"wait {TRAINER}",
        "down --volumes",
    ):
        assert f"$compose {command}" in section, command
