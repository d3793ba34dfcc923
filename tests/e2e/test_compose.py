"""docker/compose.yaml and its Dockerfiles, checked for consistency without a Docker engine.

Ports agree across each service's command, port mapping, healthcheck and the trainer's URLs; the
trainer waits for every service it calls to be healthy; every Dockerfile, COPY source, build arg,
module and script exists; the healthcheck command really tells a live service from a dead port.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import tomllib
import yaml

from tests.e2e.test_jobgroup_yaml import (
    check_module_call,
    module_calls,
    scripts_called,
    train_sh_argv,
    trainer_dry_run,
)
from tests.helpers import ROOT, free_port, small_data_server

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


def copy_sources(dockerfile_text: str) -> list[str]:
    sources = []
    for line in dockerfile_text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            sources += [s for s in line.split()[1:-1] if not s.startswith("--")]
    return sources


def test_the_four_services():
    assert set(SERVICES) == {"data-server", "reward-server", "retrieval-server", TRAINER}


@pytest.mark.parametrize("name", sorted(set(SERVICES) - {TRAINER}))
def test_port_agrees_across_command_mapping_and_healthcheck(name):
    service, port = SERVICES[name], container_port(name)
    assert any(str(mapping).split(":")[-1] == str(port) for mapping in service["ports"]), service["ports"]
    probe = " ".join(service["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/health" in probe
    assert service["healthcheck"]["test"][0] == "CMD"


def test_trainer_urls_match_services_ports_and_wait_for_health():
    trainer = SERVICES[TRAINER]
    urls = {k: v for k, v in trainer["environment"].items() if k.endswith("_SERVER_URL")}
    assert set(urls) == {"DATA_SERVER_URL", "REWARD_SERVER_URL", "RETRIEVAL_SERVER_URL"}
    for var, url in urls.items():
        host, port = URL.match(url).groups()
        assert var == host.upper().replace("-", "_") + "_URL"  # DATA_SERVER_URL -> data-server
        assert host in SERVICES and int(port) == container_port(host), url
        assert trainer["depends_on"][host] == {"condition": "service_healthy"}
        assert "healthcheck" in SERVICES[host]
    assert set(trainer["depends_on"]) == set(SERVICES) - {TRAINER}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_dockerfiles_copy_sources_and_build_args_exist(name):
    service = SERVICES[name]
    context, dockerfile = dockerfile_of(service)
    assert context == ROOT and dockerfile.is_file(), dockerfile
    text = dockerfile.read_text()
    for source in copy_sources(text):
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


def test_services_image_for_data_and_reward_has_no_torch():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("data-server", "reward-server"):
        assert SERVICES[name]["build"]["args"]["EXTRAS"] == "services"
    names = {re.split(r"[<>=\[ ;]", dep)[0].lower() for dep in extras["services"]}
    assert not names & {"torch", "sentence-transformers", "transformers"}, names
    assert SERVICES["retrieval-server"]["build"]["args"]["EXTRAS"] == "retrieval"


def run_healthcheck(test: list[str], port: int) -> int:
    argv = [a.replace(re.search(r":(\d+)/health", " ".join(test)).group(1), str(port)) for a in test[1:]]
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    return subprocess.run(argv, check=False, capture_output=True, timeout=30).returncode


def test_healthcheck_command_tells_a_live_service_from_a_dead_port():
    test = SERVICES["data-server"]["healthcheck"]["test"]
    with small_data_server() as (url, _):
        assert run_healthcheck(test, int(url.rsplit(":", 1)[1])) == 0
    assert run_healthcheck(test, free_port()) != 0


def test_trainer_command_with_compose_environment_gives_a_config_the_trainer_accepts():
    trainer = SERVICES[TRAINER]
    assert command_text(trainer) == "bash jobgroup/scripts/train.sh"
    env = {k: with_defaults(v) for k, v in trainer["environment"].items()}
    argv = train_sh_argv(env)
    keys = dict(a.split("=", 1) for a in argv[3:])
    assert keys["services.data_url"] == "'http://data-server:8000'"  # quoted: Hydra reads a,b as a sweep
    assert "services.retrieval_url" not in keys  # USE_RETRIEVAL defaults to false (the math dataset)
    assert keys["trainer.default_local_dir"].startswith("/checkpoints/")
    assert keys["trainer.logger"] == "['console']"  # WANDB_API_KEY empty by default
    trainer_dry_run(argv[3:])
