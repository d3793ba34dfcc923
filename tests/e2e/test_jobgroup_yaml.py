"""The SkyPilot YAMLs, loaded offline with SkyPilot's own loader, and the shell helpers they call.

What would break a launch that no cloud is needed to see: a malformed header, a trainer URL naming a
task or port that does not exist, a `python -m` module / subcommand / flag that is not there, a GPU on
a CPU service, checkpoints off the bucket, a health wait that does not fail when a service is down.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, free_port, small_data_server

JOBGROUP = ROOT / "jobgroup"
SCRIPTS = JOBGROUP / "scripts"
GROUP_YAMLS = ["verl-grpo.yaml", "verl-grpo-math.yaml"]
ALL_YAMLS = [*GROUP_YAMLS, "multinode.yaml"]
TRAINER = "verl-trainer"
# Which env var carries which service's URLs (the trainer's clients default from these).
URL_VARS = {
    "DATA_SERVER_URL": "data-server",
    "REWARD_SERVER_URL": "reward-server",
    "RETRIEVAL_SERVER_URL": "retrieval-server",
    "CODE_EXECUTOR_URL": "code-executor",
}
# Modules other engineers are still building: a missing one skips its check instead of failing it.
PENDING_MODULES = {"services.reward_server", "trainer.main_ppo"}
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


# ---------------------------------------------------------------- parsing the commands a YAML runs


@dataclass(frozen=True)
class ModuleCall:
    module: str
    subcommand: str | None
    flags: tuple[str, ...]
    where: str


_PYTHON_M = re.compile(r'(?:python3?|"\$python"|"\$\{PYTHON:-python\}")\s+-m\s+([A-Za-z_][\w.]*)([^\n;&|]*)')
_FLAG = re.compile(r"(?:^|[\s+\"])(--[a-z][a-z0-9-]*)")
_SCRIPT = re.compile(r"\b(jobgroup/scripts/[\w.-]+\.sh)\b")
_SUBCOMMAND = re.compile(r"^[a-z][a-z0-9_-]*$")


def join_continuations(text: str) -> str:
    return re.sub(r"\\\n\s*", " ", text)


def module_calls(text: str, where: str) -> list[ModuleCall]:
    """Every `python -m MODULE [SUBCOMMAND] --flags` in a shell text (line continuations joined)."""
    calls = []
    for match in _PYTHON_M.finditer(join_continuations(text)):
        rest = match.group(2)
        first = rest.split()[0] if rest.split() else ""
        subcommand = first if _SUBCOMMAND.match(first) else None
        calls.append(ModuleCall(match.group(1), subcommand, tuple(_FLAG.findall(rest)), where))
    return calls


def scripts_called(text: str) -> list[str]:
    return sorted(set(_SCRIPT.findall(text)))


def all_module_calls(text: str, where: str) -> list[ModuleCall]:
    """The calls in `text` plus those inside the helper scripts it runs."""
    calls = module_calls(text, where)
    for script in scripts_called(text):
        path = ROOT / script
        if path.exists():
            calls += module_calls(path.read_text(), f"{where} -> {script}")
    return calls


@functools.cache
def cli_help(module: str, subcommand: str | None) -> str:
    """`python -m module [subcommand] --help`; fails the test if that does not exit 0."""
    argv = [sys.executable, "-m", module, *([subcommand] if subcommand else []), "--help"]
    result = subprocess.run(argv, cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(argv[1:])} failed:\n{result.stderr[-2000:]}"
    return result.stdout


def runnable(module: str) -> bool:
    """What `python -m module` needs: the module, or a package with a __main__."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(module + ".__main__")
    except ModuleNotFoundError:
        return False
    return spec is not None


def check_module_call(call: ModuleCall) -> None:
    """The module is importable, the subcommand exists, every flag used appears in its --help."""
    if not runnable(call.module):
        if call.module in PENDING_MODULES:
            pytest.skip(f"{call.module} is not built yet ({call.where})")
        pytest.fail(f"{call.where}: python -m {call.module}: no such module")
    if call.module == "trainer.main_ppo":
        return  # key=value arguments, no flags
    help_text = cli_help(call.module, call.subcommand)
    missing = [flag for flag in call.flags if not re.search(re.escape(flag) + r"\b", help_text)]
    assert not missing, f"{call.where}: python -m {call.module} {call.subcommand or ''} has no {missing}"


def served_port(run: str) -> int:
    match = re.search(r"(?:--port[ =]|_PORT=)(\d+)", run)
    assert match, f"no port in run section:\n{run}"
    return int(match.group(1))


_URL_LINE = re.compile(
    r"\s*(group=|export \w+_URL=|use_\w+=\$\(bash jobgroup/scripts/flag\.sh |if .*; then export \w+_URL=)"
)


def exported_urls(run: str, group: str, envs: dict | None = None) -> dict[str, str]:
    """Run the lines of a run section that export the *_URL variables (those set only under a flag,
    such as CODE_EXECUTOR_URL, with the flag read from `envs`) in bash and read back the URLs."""
    lines = [line for line in run.splitlines() if _URL_LINE.match(line)]
    script = "set -eu\n" + "\n".join(lines) + "\nenv | grep '_URL=' || true\n"
    flags = {k: str(v) for k, v in (envs or {}).items() if k.startswith("USE_")}
    result = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "SKYPILOT_JOBGROUP_NAME": group, **flags},
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(line.split("=", 1) for line in result.stdout.split())


# ---------------------------------------------------------------- loading


def load(name: str, env: dict | None = None, secrets: dict | None = None):
    """SkyPilot's own loader (imported here so test_compose can share the helpers without SkyPilot)."""
    from sky.utils import dag_utils

    return dag_utils.load_dag_from_yaml(
        str(JOBGROUP / name),
        env_overrides=list((env or {}).items()) or None,
        secrets_overrides=list((secrets or {}).items()) or None,
    )


def tasks_by_name(dag) -> dict:
    return {task.name: task for task in dag.tasks}


def accelerators(task) -> list:
    return [r.accelerators for r in task.resources if r.accelerators]


# ---------------------------------------------------------------- the job groups


@pytest.mark.parametrize("name", GROUP_YAMLS)
def test_job_group_header_and_tasks(name):
    header = next(yaml.safe_load_all((JOBGROUP / name).read_text()))
    assert set(header) == {"name", "execution", "primary_tasks", "termination_delay"}
    assert header["execution"] == "parallel"
    dag = load(name)
    assert dag.is_job_group() and dag.name == header["name"]
    assert dag.primary_tasks == [TRAINER]
    tasks = tasks_by_name(dag)
    assert TRAINER in tasks and {"data-server", "reward-server"} <= set(tasks)
    assert sorted(dag.get_auxiliary_task_names()) == sorted(set(tasks) - {TRAINER})
    assert dag.get_termination_delay_secs("data-server") >= 10
    for task_name in tasks:  # hostnames are {task}-{i}.{group}: DNS labels
        assert DNS_LABEL.match(task_name), task_name
    assert ("retrieval-server" in tasks) == (name == "verl-grpo.yaml")
    assert ("code-executor" in tasks) == (name == "verl-grpo.yaml")


@pytest.mark.parametrize("name", GROUP_YAMLS)
@pytest.mark.parametrize("use_code_executor", ["false", "true"])
def test_trainer_urls_name_real_tasks_ports_and_every_replica(name, use_code_executor):
    tasks = tasks_by_name(load(name, env={"USE_CODE_EXECUTOR": use_code_executor}))
    run = tasks[TRAINER].run
    assert "group=$SKYPILOT_JOBGROUP_NAME" in run
    urls = exported_urls(run, group="g1", envs=tasks[TRAINER].envs)
    services = {n: t for n, t in tasks.items() if n != TRAINER}
    if use_code_executor == "false":  # the code-executor serves nothing: the trainer gets no URL for it
        services.pop("code-executor", None)
    assert {URL_VARS[var] for var in urls} == set(services), urls  # one URL variable per service, no more
    for var, value in urls.items():
        service = URL_VARS[var]
        expected = [
            f"http://{service}-{i}.g1:{served_port(services[service].run)}"
            for i in range(services[service].num_nodes)
        ]
        assert value.split(",") == expected, f"{var}={value}"
    if name == "verl-grpo.yaml":
        assert services["retrieval-server"].num_nodes == 2
        assert len(urls["RETRIEVAL_SERVER_URL"].split(",")) == 2


def waited_services(run: str, envs: dict) -> subprocess.CompletedProcess:
    """Run the trainer's wait step in bash, printing the NAME=URL arguments instead of waiting."""
    lines = run.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("waits=("))
    end = next(i for i, line in enumerate(lines) if "wait_for_services.sh" in line)
    step = "\n".join(lines[start : end + 1]).replace(
        "bash jobgroup/scripts/wait_for_services.sh", "printf '%s\\n'"
    )
    env = {"PATH": os.environ["PATH"], **{k: str(v) for k, v in envs.items()}}
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + step], cwd=ROOT, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize("name", GROUP_YAMLS)
@pytest.mark.parametrize("use_retrieval", ["false", "true"])
@pytest.mark.parametrize("use_code_executor", ["false", "true"])
def test_trainer_waits_only_for_the_services_it_calls(name, use_retrieval, use_code_executor):
    flags = {"USE_RETRIEVAL": use_retrieval, "USE_CODE_EXECUTOR": use_code_executor}
    tasks = tasks_by_name(load(name, env=flags))
    run = join_continuations(tasks[TRAINER].run)
    envs = {**tasks[TRAINER].envs, **exported_urls(run, group="g5", envs=tasks[TRAINER].envs)}
    done = waited_services(run, envs)
    assert done.returncode == 0, done.stderr
    waited = dict(arg.split("=", 1) for arg in done.stdout.split())
    expected = {"data-server", "reward-server"}
    if use_retrieval == "true" and "retrieval-server" in tasks:  # retrieval only when the run uses it
        expected.add("retrieval-server")
    if use_code_executor == "true" and "code-executor" in tasks:  # the same for the code-executor
        expected.add("code-executor")
    assert set(waited) == expected
    for service, urls in waited.items():  # each waits on every replica of that service
        assert urls == next(value for var, value in envs.items() if URL_VARS.get(var) == service)
    if name == "verl-grpo.yaml":
        bad = waited_services(run, {**envs, "USE_RETRIEVAL": "maybe"})
        assert bad.returncode == 2 and "USE_RETRIEVAL=maybe is not a flag" in bad.stderr


# ---------------------------------------------------------------- the code-executor (USE_CODE_EXECUTOR)


def run_section(
    text: str, envs: dict, group: str = "g6", swap: dict | None = None
) -> subprocess.CompletedProcess:
    """A task's setup or run in bash as SkyPilot runs it, less the venv activation, with the commands
    in `swap` replaced (say, a server by `echo`)."""
    script = "\n".join(line for line in text.splitlines() if not line.strip().startswith("source "))
    for old, new in (swap or {}).items():
        script = script.replace(old, new)
    env = {
        "PATH": os.environ["PATH"],
        "SKYPILOT_JOBGROUP_NAME": group,
        **{k: str(v) for k, v in envs.items()},
    }
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("flag", ["false", "true"])
def test_code_executor_task_installs_and_serves_only_when_asked(flag):
    task = tasks_by_name(load("verl-grpo.yaml", env={"USE_CODE_EXECUTOR": flag}))["code-executor"]
    swap = {
        "bash jobgroup/scripts/setup_venv.sh": "echo INSTALL",
        "python -m services.code_executor": "echo SERVE",
    }
    setup, run = run_section(task.setup, task.envs, swap=swap), run_section(task.run, task.envs, swap=swap)
    assert setup.returncode == 0 and run.returncode == 0, setup.stderr + run.stderr
    if flag == "true":
        assert setup.stdout.split() == ["INSTALL", "services"]  # bubblewrap comes with the services extra
        assert run.stdout.split() == ["SERVE", "--port", "8003"]
    else:  # nothing installed or served: the task ends at once (an auxiliary task: the group goes on)
        assert "INSTALL" not in setup.stdout and "SERVE" not in run.stdout
        assert "USE_CODE_EXECUTOR is off" in run.stdout
    bad = run_section(task.run, {**task.envs, "USE_CODE_EXECUTOR": "maybe"}, swap=swap)
    assert bad.returncode == 2 and "USE_CODE_EXECUTOR=maybe is not a flag" in bad.stderr


@pytest.mark.parametrize("flag", ["false", "true"])
def test_reward_server_scores_code_on_the_code_executor_only_when_asked(flag):
    tasks = tasks_by_name(load("verl-grpo.yaml", env={"USE_CODE_EXECUTOR": flag}))
    done = run_section(tasks["reward-server"].run, {**tasks["reward-server"].envs, "DRY_RUN": "1"})
    assert done.returncode == 0, done.stderr
    argv = done.stdout.split()
    assert argv[:5] == ["python", "-m", "services.reward_server", "--port", "8001"]
    flags = tuple(arg for arg in argv if arg.startswith("--"))
    check_module_call(ModuleCall("services.reward_server", None, flags, "verl-grpo.yaml/reward-server"))
    urls = exported_urls(tasks[TRAINER].run, group="g6", envs=tasks[TRAINER].envs)
    if flag == "true":  # the address the trainer's code tool calls: the code-executor task, on its port
        expected = f"http://code-executor-0.g6:{served_port(tasks['code-executor'].run)}"
        assert argv[argv.index("--code-executor-url") + 1] == urls["CODE_EXECUTOR_URL"] == expected
    else:
        assert "--code-executor-url" not in argv and "CODE_EXECUTOR_URL" not in urls


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"USE_CODE_EXECUTOR": "true"},
        {"TOOL_FORMAT": "hermes"},
        {"USE_CODE_EXECUTOR": "true", "TOOL_FORMAT": "search_r1"},
    ],
    ids=["search", "code", "hermes", "code-search_r1"],
)
def test_data_server_qa_prompts_teach_the_format_the_trainer_parses(env):
    """With the hermes format (the code tool) nq_hotpotqa's prompts must not teach Search-R1's tags, which
    the hermes parser does not read: the data-server task's --qa-instruction follows train.sh's format."""
    tasks = tasks_by_name(load("verl-grpo.yaml", env=env))
    task = tasks["data-server"]
    done = run_section(task.run, task.envs, swap={"python -m services.data_server": "echo SERVE"})
    assert done.returncode == 0, done.stderr
    argv = done.stdout.split()
    flags = tuple(arg for arg in argv if arg.startswith("--"))
    check_module_call(ModuleCall("services.data_server", None, flags, "verl-grpo.yaml/data-server"))
    trained = train_sh_argv(
        {**tasks[TRAINER].envs, "CODE_EXECUTOR_URL": "http://c:8003", "RETRIEVAL_SERVER_URL": "http://r:8002"}
    )
    trained_format = next(
        a.partition("=")[2] for a in trained if a.startswith("actor_rollout_ref.rollout.multi_turn.format=")
    )
    assert argv[argv.index("--qa-instruction") + 1] == (
        "tools" if trained_format == "hermes" else "search_r1"
    )
    bad = run_section(task.run, {**task.envs, "USE_CODE_EXECUTOR": "maybe"})
    assert bad.returncode == 2 and "USE_CODE_EXECUTOR=maybe is not a flag" in bad.stderr


def test_train_sh_with_the_code_executor_trains_with_its_tool(monkeypatch):
    trainer = tasks_by_name(load("verl-grpo.yaml", env={"USE_CODE_EXECUTOR": "yes"}))[TRAINER]
    urls = exported_urls(trainer.run, group="g7", envs=trainer.envs)
    argv = train_sh_argv({**trainer.envs, **urls})
    keys = dict(a.split("=", 1) for a in argv[3:])
    key = "actor_rollout_ref.rollout.multi_turn"
    assert keys[f"{key}.enable"] == "True"
    assert keys[f"{key}.format"] == "hermes"  # Search-R1's tags call the search tool alone
    assert (
        keys[f"{key}.tool_config_path"] == "jobgroup/tools/search_code_tool_config.yaml"
    )  # with USE_RETRIEVAL
    # the file takes its URLs from the trainer's env: each tool calls its service by its job-group name
    from trainer.agent.tools import load_tool_config

    for var in ("RETRIEVAL_SERVER_URL", "CODE_EXECUTOR_URL"):
        monkeypatch.setenv(var, urls[var])
    search, code = load_tool_config(ROOT / keys[f"{key}.tool_config_path"]).tools
    assert (search.name, code.name) == ("search", "code_interpreter")
    assert search.urls == ("http://retrieval-server-0.g7:8002", "http://retrieval-server-1.g7:8002")
    assert code.urls == ("http://code-executor-0.g7:8003",)
    trainer_dry_run(argv[3:])
    # the code tool alone, on a dataset without retrieval
    alone = train_sh_argv({**trainer.envs, **urls, "USE_RETRIEVAL": "false", "DATASET": "gsm8k"})
    keys = dict(a.split("=", 1) for a in alone[3:])
    assert keys[f"{key}.tool_config_path"] == "jobgroup/tools/code_tool_config.yaml"
    assert keys[f"{key}.format"] == "hermes" and "services.retrieval_url" not in keys
    trainer_dry_run(alone[3:])


@pytest.mark.parametrize("name", GROUP_YAMLS)
def test_trainer_starts_ray_then_waits_then_trains(name):
    run = join_continuations(tasks_by_name(load(name))[TRAINER].run)
    lines = [line for line in run.splitlines() if "--follow" not in line]  # rank 0's path
    order = [
        next(i for i, line in enumerate(lines) if key in line)
        for key in ("start_ray.sh", "wait_", "train.sh")
    ]
    assert order == sorted(order), "Ray head, then the health wait, then training"
    assert "set -euo pipefail" in run  # a failed wait stops the task before training


@pytest.mark.parametrize("name", ALL_YAMLS)
def test_every_cli_the_yaml_calls_exists(name):
    dag = load(name)
    for task in dag.tasks:
        text = f"{task.setup or ''}\n{task.run or ''}"
        for script in scripts_called(text):
            assert (ROOT / script).is_file(), f"{name}/{task.name}: {script} does not exist"
        calls = all_module_calls(text, f"{name}/{task.name}")
        assert calls, f"{name}/{task.name} runs no python module"
        for call in calls:
            if call.module not in PENDING_MODULES:
                check_module_call(call)
    pending = [
        c for t in dag.tasks for c in all_module_calls(t.run or "", t.name) if c.module in PENDING_MODULES
    ]
    for call in pending:  # last, since a not-yet-built module skips the rest of the test
        check_module_call(call)


@pytest.mark.parametrize("name", ALL_YAMLS)
def test_gpus_only_where_training_runs(name):
    dag = load(name)
    for task in dag.tasks:
        if task.name in (TRAINER, "rl-multinode"):
            assert accelerators(task), f"{task.name} has no GPU"
            assert any("8280" in (r.ports or []) for r in task.resources), "Ray dashboard port not exposed"
        else:
            assert not accelerators(task), f"CPU service {task.name} asks for {accelerators(task)}"
            assert all(r.cpus for r in task.resources), f"{task.name} names no CPU count"


@pytest.mark.parametrize("name", ALL_YAMLS)
def test_checkpoints_on_a_bucket_and_resume_auto(name):
    dag = load(name, env={"CHECKPOINT_BUCKET_NAME": "my-ckpt-bucket"})  # the SkyPilot example's name
    trainer = next(t for t in dag.tasks if accelerators(t))
    mount = trainer.storage_mounts["/checkpoints"]
    assert mount.name == "my-ckpt-bucket"  # the --env override reaches the bucket name
    assert mount.mode.value in ("MOUNT", "MOUNT_CACHED")
    if name == "multinode.yaml":
        args = join_continuations(trainer.run)
        assert "trainer.resume_mode=auto" in args
        assert re.search(r"trainer\.default_local_dir=/checkpoints/", args)
    else:
        argv = train_sh_argv({**trainer.envs, **exported_urls(trainer.run, group="g0")})
        assert "trainer.resume_mode=auto" in argv
        assert next(a for a in argv if a.startswith("trainer.default_local_dir=")).startswith(
            "trainer.default_local_dir=/checkpoints/"
        )


# ---------------------------------------------------------------- train.sh: envs -> trainer keys


def train_sh_argv(envs: dict, extra: tuple[str, ...] = ()) -> list[str]:
    env = {"PATH": os.environ["PATH"], "DRY_RUN": "1", **{k: str(v) for k, v in envs.items()}}
    result = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh"), *extra],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_train_sh_maps_the_trainer_envs_to_trainer_keys():
    trainer = tasks_by_name(load("verl-grpo.yaml", env={"TOTAL_STEPS": "7"}, secrets={"WANDB_API_KEY": "k"}))[
        TRAINER
    ]
    urls = exported_urls(trainer.run, group="g2")
    envs = {**trainer.envs, **{k: v.get_secret_value() for k, v in trainer.secrets.items()}, **urls}
    argv = train_sh_argv({**envs, "USE_RETRIEVAL": "true"}, extra=("actor_rollout_ref.rollout.n=8",))
    assert argv[:3] == ["python", "-m", "trainer.main_ppo"]
    keys = dict(a.split("=", 1) for a in argv[3:])
    # micro-batches that fit the YAML's 80 GB GPU (train.sh states the arithmetic)
    assert keys["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "8"
    assert keys["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"] == "16"
    assert keys["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] == "16"
    assert keys["actor_rollout_ref.rollout.multi_turn.enable"] == "True"  # USE_RETRIEVAL: the search tool
    assert keys["actor_rollout_ref.rollout.multi_turn.format"] == "search_r1"
    assert keys["algorithm.adv_estimator"] == "grpo"
    # Search-R1's QA set, which the group's data-server serves under that name
    assert keys["data.source"] == "server" and keys["data.dataset"] == "nq_hotpotqa"
    data_server = tasks_by_name(load("verl-grpo.yaml"))["data-server"]
    assert "nq_hotpotqa=hub:PeterJinGo/nq_hotpotqa_train" in data_server.envs["DATASETS"].split()
    assert keys["trainer.val_before_train"] == "False" and keys["trainer.test_freq"] == "-1"
    assert keys["actor_rollout_ref.model.path"] == trainer.envs["MODEL_NAME"]
    assert keys["trainer.total_training_steps"] == "7"  # the --env override
    assert keys["data.train_batch_size"] == str(trainer.envs["TRAIN_BATCH_SIZE"])
    assert keys["trainer.logger"] == "['console','wandb']"  # the secret is set
    assert (  # quoted, so Hydra reads the replica list as text rather than a sweep
        keys["services.retrieval_url"]
        == "'http://retrieval-server-0.g2:8002,http://retrieval-server-1.g2:8002'"
    )
    assert keys["services.data_url"] == "'http://data-server-0.g2:8000'"
    assert argv[-1] == "actor_rollout_ref.rollout.n=8"  # extra keys come last, so they win
    assert keys["actor_rollout_ref.rollout.name"] == "auto"  # the built-in engine, not transformers'
    # packed micro-batches, a prompt's samples sharing its pass (the same gradients, fewer tokens) ...
    assert keys["actor_rollout_ref.model.use_remove_padding"] == keys["actor_rollout_ref.model.share_prompts"]
    assert keys["actor_rollout_ref.model.share_prompts"] == "True"
    trainer_dry_run(argv[3:])
    # ... and off with packing (shared prompts need it), or on their own
    for envs_off, want in (
        ({"USE_REMOVE_PADDING": "no"}, ("False", "False")),
        ({"SHARE_PROMPTS": "0"}, ("True", "False")),
    ):
        off = dict(a.split("=", 1) for a in train_sh_argv({**envs, **envs_off})[3:])
        assert (
            off["actor_rollout_ref.model.use_remove_padding"],
            off["actor_rollout_ref.model.share_prompts"],
        ) == want


def test_train_sh_hands_the_groups_token_to_the_trainer_off_the_command_line(tmp_path):
    # the code-executor's token (the group's shared setting) reaches the trainer as SERVICES_AUTH_TOKEN,
    # which services.auth_token reads: in the environment, not in the command line train.sh prints
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\necho "token=$SERVICES_AUTH_TOKEN"\necho "args=$*"\n')
    fake_python.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "PYTHON": str(fake_python), "CODE_EXECUTOR_AUTH_TOKEN": "s3cret"}
    done = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh")], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "token=s3cret" in lines
    assert not any("s3cret" in line for line in lines if not line.startswith("token="))


def test_train_sh_math_variant_has_no_retrieval_and_console_only_without_secret():
    trainer = tasks_by_name(load("verl-grpo-math.yaml"))[TRAINER]
    envs = {**trainer.envs, **{k: v.get_secret_value() for k, v in trainer.secrets.items()}}
    envs.update(exported_urls(trainer.run, group="g3"))
    keys = dict(a.split("=", 1) for a in train_sh_argv(envs)[3:])
    assert "services.retrieval_url" not in keys
    assert keys["trainer.logger"] == "['console']"
    assert "trainer.total_training_steps" in keys


@pytest.mark.parametrize(
    "flag, url", [("USE_RETRIEVAL", "RETRIEVAL_SERVER_URL"), ("USE_CODE_EXECUTOR", "CODE_EXECUTOR_URL")]
)
def test_train_sh_refuses_a_tool_without_a_url(flag, url):
    result = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh")],
        env={"PATH": os.environ["PATH"], "DRY_RUN": "1", flag: "1"},
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and f"{flag} is on but {url} is not set" in result.stderr


@pytest.mark.parametrize(
    "word, on", [("true", True), ("True", True), ("1", True), ("yes", True), ("on", True),
                 ("false", False), ("FALSE", False), ("0", False), ("no", False), ("", False)],
)  # fmt: skip
def test_train_sh_reads_every_flag_spelling(word, on):
    urls = {"RETRIEVAL_SERVER_URL": "http://r:8002"}
    keys = dict(a.split("=", 1) for a in train_sh_argv({**urls, "USE_RETRIEVAL": word, "DRY_RUN": "yes"})[3:])
    assert ("actor_rollout_ref.rollout.multi_turn.enable" in keys) == on
    assert (keys.get("services.retrieval_url") == "'http://r:8002'") == on
    done = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh")],
        env={"PATH": os.environ["PATH"], "USE_RETRIEVAL": "maybe", "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2 and "USE_RETRIEVAL=maybe is not a flag: use true/false" in done.stderr


def test_skypilot_example_env_names_reach_the_trainer():
    base = {"DATA_SERVER_URL": "http://d:8000"}
    keys = dict(
        a.split("=", 1)
        for a in train_sh_argv(
            {**base, "VAL_BATCH_SIZE": "64", "WANDB_PROJECT_NAME": "proj", "WANDB_EXPERIMENT_NAME": "exp"}
        )[3:]
    )
    assert keys["data.val_batch_size"] == "64"
    assert keys["trainer.project_name"] == "proj" and keys["trainer.experiment_name"] == "exp"
    assert keys["trainer.default_local_dir"] == "checkpoints/proj/exp"
    # our own names, when given, win over the example's
    ours = dict(
        a.split("=", 1) for a in train_sh_argv({**base, "WANDB_PROJECT_NAME": "p", "PROJECT_NAME": "q"})[3:]
    )
    assert ours["trainer.project_name"] == "q" and "data.val_batch_size" not in ours
    # CHECKPOINT_BUCKET_NAME names the bucket of every YAML (test_checkpoints_on_a_bucket_and_resume_auto);
    # the YAMLs declare the example's names, so `--env NAME=...` overrides reach the scripts
    trainer = tasks_by_name(
        load("verl-grpo.yaml", env={"WANDB_PROJECT_NAME": "cli", "VAL_BATCH_SIZE": "32"})
    )[TRAINER]
    urls = {"RETRIEVAL_SERVER_URL": "http://r:8002"}  # the group's run exports it (USE_RETRIEVAL is on)
    keys = dict(a.split("=", 1) for a in train_sh_argv({**trainer.envs, **urls})[3:])
    assert keys["trainer.project_name"] == "cli" and keys["data.val_batch_size"] == "32"


def serve_retrieval_dry_run(envs: dict, *args: str) -> list[list[str]]:
    """The commands serve_retrieval.sh would run (DRY_RUN), each as its argv."""
    env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent-home", "DRY_RUN": "true", **envs}
    done = subprocess.run(
        ["bash", str(SCRIPTS / "serve_retrieval.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [block.split("\n") for block in done.stdout.strip().split("\n\n")]


def test_skypilot_example_retrieval_env_names_reach_the_retrieval_server():
    task = tasks_by_name(load("verl-grpo.yaml", env={"RETRIEVER_NAME": "bm25", "RETRIEVAL_TOPK": "5"}))[
        "retrieval-server"
    ]
    build, serve = serve_retrieval_dry_run({**task.envs, "RETRIEVAL_PORT": "8002"})
    assert build[2:4] == ["services.retrieval_server", "build"]
    assert build[build.index("--index") + 1] == "bm25" and "--embedder" not in build
    assert serve[2:4] == ["services.retrieval_server", "serve"]
    assert serve[serve.index("--default-topk") + 1] == "5" and serve[serve.index("--port") + 1] == "8002"
    dense, _ = serve_retrieval_dry_run(
        {"RETRIEVAL_CORPUS": "c.jsonl", "RETRIEVER_NAME": "e5", "RETRIEVER_MODEL": "intfloat/e5-base-v2"}
    )
    assert dense[dense.index("--index") + 1] == "flat"
    assert dense[dense.index("--embedder") + 1] == "intfloat/e5-base-v2"
    # the trainer's search tool reads RETRIEVAL_TOPK too (verl resolves its config with OmegaConf)
    from omegaconf import OmegaConf

    tool = OmegaConf.load(JOBGROUP / "tools" / "search_tool_config.yaml").tools[0].config
    os.environ["RETRIEVAL_TOPK"] = "5"
    try:
        assert OmegaConf.to_container(tool, resolve=True)["topk"] == 5
    finally:
        del os.environ["RETRIEVAL_TOPK"]


def test_ray_uses_the_skypilot_examples_ports():
    start_ray = (SCRIPTS / "start_ray.sh").read_text()
    assert "port=${RAY_PORT:-6385}" in start_ray and "dashboard_port=${RAY_DASHBOARD_PORT:-8280}" in start_ray
    for name in ALL_YAMLS:
        task = next(t for t in load(name).tasks if accelerators(t))
        assert str(task.envs["RAY_PORT"]) == "6385" and str(task.envs["RAY_DASHBOARD_PORT"]) == "8280"


def trainer_dry_run(argv: list[str], *, only_refused: str | None = None) -> None:
    """`python -m trainer.main_ppo --dry-run ...`: the trainer's own check of every key and value.

    only_refused: the one problem allowed, e.g. a feature the trainer does not have yet (multi-turn).
    """
    if not runnable("trainer.main_ppo"):
        pytest.skip("trainer.main_ppo is not built yet")
    result = subprocess.run(
        [sys.executable, "-m", "trainer.main_ppo", "--dry-run", *argv],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if only_refused:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
        assert only_refused in errors[0]
        return
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("name", GROUP_YAMLS)
def test_trainer_accepts_the_keys_train_sh_passes(name):
    trainer = tasks_by_name(load(name, secrets={"WANDB_API_KEY": "k"}))[TRAINER]
    envs = {**trainer.envs, **exported_urls(trainer.run, group="g4")}
    argv = train_sh_argv(envs)
    assert argv[:3] == ["python", "-m", "trainer.main_ppo"]
    trainer_dry_run(argv[3:])
    if name == "verl-grpo.yaml":  # the group's own setting: multi-turn with the search tool
        assert str(trainer.envs["USE_RETRIEVAL"]) == "true"
        assert "actor_rollout_ref.rollout.multi_turn.enable=True" in argv
        off = train_sh_argv({**envs, "USE_RETRIEVAL": "false", "DATASET": "gsm8k"})
        assert not any("multi_turn" in arg for arg in off)
        trainer_dry_run(off[3:])


def multinode_trainer_argv(task, home: Path) -> list[str]:
    """The main_ppo arguments of multinode.yaml's `ray job submit`, expanded by bash with the task's envs."""
    run = join_continuations(task.run)
    args = run.split("python -m trainer.main_ppo", 1)[1].splitlines()[0]
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "SKYPILOT_NUM_NODES": str(task.num_nodes),
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        **{k: str(v) for k, v in task.envs.items()},
    }
    script = "logger=\"['console']\"\nprintf '%s\\n' " + args
    return subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()


def test_trainer_accepts_the_keys_multinode_submits(tmp_path):
    # The head's data step, for real but offline: the same export, of the synthetic set, where the run
    # expects it.
    out = tmp_path / "data" / "gsm8k"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "services.data_server",
            "export",
            "synthetic-arith",
            "--out",
            str(out),
            "--train-size",
            "16",
            "--test-size",
            "4",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    argv = multinode_trainer_argv(load("multinode.yaml").tasks[0], home=tmp_path)
    assert f"data.train_files={out}/train.parquet" in argv
    assert "reward_model.mode=local" in argv  # no reward-server in this shape
    trainer_dry_run(argv)  # 2 nodes x 8 GPUs: accepted (Ray role groups)


# ---------------------------------------------------------------- multinode.yaml


def test_multinode_shape_and_env_overrides():
    overrides = {"MODEL_NAME": "my/model", "ACTOR_LR": "3e-6", "CRITIC_LR": "3e-5", "TOTAL_EPOCHS": "5"}
    dag = load("multinode.yaml", env=overrides)
    assert not dag.is_job_group() and len(dag.tasks) == 1
    task = dag.tasks[0]
    assert task.num_nodes >= 2
    assert {k: task.envs[k] for k in overrides} == overrides
    run = join_continuations(task.run)
    for key, var in [
        ("actor_rollout_ref.model.path", "MODEL_NAME"),
        ("critic.model.path", "MODEL_NAME"),
        ("actor_rollout_ref.actor.optim.lr", "ACTOR_LR"),
        ("critic.optim.lr", "CRITIC_LR"),
        ("trainer.total_epochs", "TOTAL_EPOCHS"),
    ]:
        assert f"{key}=${var}" in run, key
    # head: export data, start or reuse the Ray head, submit; workers: join
    export = next(c for c in module_calls(run, "multinode") if c.module == "services.data_server")
    assert export.subcommand == "export" and "--out" in export.flags
    assert "data.train_files=$HOME/data/gsm8k/train.parquet" in run
    assert "ray job submit" in run and run.index("start_ray.sh") < run.index("ray job submit")
    assert "reusing it" in (SCRIPTS / "start_ray.sh").read_text()


# ---------------------------------------------------------------- the shell helpers


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_scripts_are_valid_bash_and_executable(script):
    path = SCRIPTS / script
    assert subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True).returncode == 0
    assert os.access(path, os.X_OK)


def run_wait(*args: str, timeout_s: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run(
        ["bash", str(SCRIPTS / "wait_for_services.sh"), "--interval", "0.2", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return result, time.monotonic() - start


def test_wait_for_services_against_a_real_data_server_and_a_dead_port():
    dead = f"http://127.0.0.1:{free_port()}"
    with small_data_server() as (url, _):
        ok, _ = run_wait("--timeout", "30", f"data-server={url}")
        assert ok.returncode == 0, ok.stderr
        assert f"healthy: data-server {url}" in ok.stdout

        # One healthy replica does not make the service healthy: the dead one is named.
        failed, elapsed = run_wait("--timeout", "3", f"data-server={url},{dead}", f"reward-server={dead}")
    assert failed.returncode == 1
    assert elapsed < 3 + 8, elapsed  # gives up at its deadline (plus one probe), not later
    errors = failed.stderr.strip().splitlines()
    assert errors == [
        f"error: service data-server never became healthy within 3s: {dead}/health (last: connection "
        "refused)",
        f"error: service reward-server never became healthy within 3s: {dead}/health (last: "
        "connection refused)",
    ]


def test_wait_for_services_usage_errors():
    result, _ = run_wait("data-server=")
    assert result.returncode == 2 and "data-server has no URL" in result.stderr
    result, _ = run_wait("not-a-spec")
    assert result.returncode == 2 and "expected NAME=URL" in result.stderr
