"""The docs cannot drift: docs/config.md is the schema's reference; the README's test command is CI's."""

import os
import re
import shlex
import subprocess
import sys

from tests.helpers import ROOT
from trainer.config import config_reference_markdown


def test_docs_config_is_the_generated_reference():
    written = (ROOT / "docs" / "config.md").read_text()
    assert written == config_reference_markdown(), (
        "docs/config.md is stale: regenerate it with `python -m trainer.config --markdown > docs/config.md`"
    )


def test_readme_links_the_reference_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/config.md)" in readme
    assert len(readme.encode()) < 25_000, "README.md is over 25 KB: move detail into docs/"


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("```bash") < readme.index("\n## ")  # the commands come before any section
    first_block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1).splitlines()
    assert first_block[0].startswith("bash quickstart.sh")
    assert first_block[1].startswith(".venv/bin/python -m pytest -q")
    test_command = first_block[1].split("#")[0].strip().removeprefix(".venv/bin/")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci and "source .venv/bin/activate" in ci  # CI runs the README's command as written


# ------------------------------------------------------------------------------- every README command

# What each program needs beyond a fresh clone with its venv; commands of these are listed, not run.
NOT_RUN_HERE = {
    "sky": "SkyPilot and a cloud",
    "docker": "a Docker engine (tests/e2e/test_compose.py runs the compose group)",
    "$compose": "a Docker engine (tests/e2e/test_compose.py)",
    "curl": "a running service (tests/services/test_docs_requests.py sends each to one)",
    "bash": "the whole setup or demo (CI runs quickstart.sh --setup-only)",
}
SHELL_SETUP = ("export", "compose=", "source")  # environment lines, nothing to check


COMMAND_DOCS = ("README.md", "docs/services.md")  # the pages whose commands a newcomer copies


def readme_commands() -> list[tuple[str, str]]:
    """(command, its comment) for every line of the bash blocks of the README and docs/services.md,
    continuations joined."""
    readme = "\n".join((ROOT / doc).read_text() for doc in COMMAND_DOCS)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL):
        text, pending = re.sub(r"\\\n\s*", " ", block), ""
        for line in text.splitlines():
            if not pending and line.strip().startswith("#"):
                continue
            pending += line
            if pending.partition("  #")[0].count("'") % 2:  # a quoted body goes on (curl -d '{...}')
                continue
            command, _, comment = pending.partition("  #")
            command, pending = command.strip(), ""
            if command and not command.startswith("#"):
                commands.append((command, comment.strip()))
    return commands


def python_module(command: str) -> tuple[str, list[str]] | None:
    """('trainer.main_ppo', [args]) for `python -m ...` or `.venv/bin/python -m ...`."""
    try:
        words = shlex.split(command.split("$(")[0])
    except ValueError:  # quotes closed on a later line (a curl body): not a python command anyway
        words = command.split()
    if len(words) >= 3 and words[0] in ("python", ".venv/bin/python") and words[1] == "-m":
        return words[2], words[3:]
    return None


def test_every_readme_command_is_checked_here_or_needs_what_it_names():
    for command, _ in readme_commands():
        program = command.split()[0]
        assert python_module(command) or program in NOT_RUN_HERE or command.startswith(SHELL_SETUP), (
            f"README command not covered by tests/unit/test_readme.py: {command}"
        )


# `Org/Name` as a whole value, where a model is named (`model.path=Qwen/Qwen2.5-0.5B-Instruct`,
# `--embedder intfloat/e5-base-v2`) or marked `hub:` (`gsm8k=hub:openai/gsm8k`); not a repository path.
HUB_ID = re.compile(r"^(hub:)?([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)$")
MODEL_KEYS = ("model", "embedder")
FILE_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".parquet", ".gguf", ".py")


def hub_id(key: str, value: str) -> str | None:
    found = HUB_ID.match(value)
    if found is None or found.group(2).endswith(FILE_SUFFIXES) or (ROOT / found.group(2)).exists():
        return None
    names_a_model = any(word in key.lower() for word in MODEL_KEYS)
    return found.group(2) if found.group(1) or names_a_model else None


def config_hub_ids(path: str, overridden: set[str]) -> list[str]:
    """The hub ids a --config / config= YAML names, but not under keys the command line sets itself."""
    import yaml

    def walk(node, key: str) -> list[str]:
        if key in overridden:
            return []
        if isinstance(node, dict):
            return [i for k, v in node.items() for i in walk(v, f"{key}.{k}" if key else str(k))]
        if isinstance(node, list):
            return [i for v in node for i in walk(v, key)]
        return [found] if isinstance(node, str) and (found := hub_id(key, node)) else []

    return walk(yaml.safe_load((ROOT / path).read_text()), "")


def hub_ids_of(command: str) -> list[str]:
    """The hub ids a python command needs: in its arguments (`key=value`, `--option value`), or in the
    config file it names (--config FILE, or jobgroup.local's config=FILE)."""
    found = python_module(command)
    if found is None:
        return []
    args = found[1]
    pairs = [tuple(arg.split("=", 1)) for arg in args if "=" in arg and not arg.startswith("-")]
    pairs += [(a, b) for a, b in zip(args, args[1:]) if a.startswith("--")]
    ids = [found for key, value in pairs if (found := hub_id(key, value))]
    overridden = {key.lstrip("+") for key, _ in pairs}
    configs = [value for key, value in pairs if key in ("--config", "config")]
    return ids + [i for path in configs for i in config_hub_ids(path, overridden)]


def marked_hub(comment: str) -> bool:
    return comment.startswith("hub") or comment.endswith("(hub)")


def test_hub_ids_are_found_in_arguments_and_config_files():
    ppo = "python -m trainer.main_ppo --config trainer/configs/ppo_gsm8k.yaml"
    assert hub_ids_of(f"{ppo} actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct")
    assert hub_ids_of("python -m services.data_server --datasets gsm8k=hub:openai/gsm8k") == ["openai/gsm8k"]
    # trainer/configs/ppo_gsm8k.yaml names Qwen/Qwen2.5-0.5B-Instruct for the actor and the critic ...
    assert len(hub_ids_of(ppo)) == 2
    # ... unless the command line sets both
    assert hub_ids_of(f"{ppo} actor_rollout_ref.model.path=/m critic.model.path=/m") == []
    # local paths, repository files, and paths that do not name a model
    assert hub_ids_of("python -m trainer.main_ppo trainer.log_dir=runs/x --out runs/y") == []
    assert hub_ids_of("python -m trainer.main_ppo actor_rollout_ref.model.path=testing/tiny.py") == []
    assert hub_ids_of("python -m services.data_server export gsm8k --source DIR --out ~/data/gsm8k") == []


def test_each_readme_command_that_needs_the_hub_is_marked_and_has_its_offline_twin_beside_it():
    """A command needs the hub by its mark (`# hub ...` or `... (hub)`) or by what it names: an Org/Name
    id in its arguments or in its config file (python commands only: the others need a cloud or a GPU
    node anyway). Each such command has an offline twin within two commands of it."""
    commands = readme_commands()
    for command, comment in commands:
        ids = hub_ids_of(command)
        assert not ids or marked_hub(comment), f"needs the hub ({ids[0]}) but has no `# hub` mark: {command}"
    hub = [i for i, (command, comment) in enumerate(commands) if marked_hub(comment) or hub_ids_of(command)]
    # the data-server and its export, an embedder, the trainer, PPO's config, jobgroup.local
    assert len(hub) >= 6
    for index in hub:
        nearby = commands[max(index - 2, 0) : index + 3]
        assert any("offline" in comment for _, comment in nearby), f"no offline twin: {commands[index][0]}"


SUBCOMMANDS = {"services.retrieval_server": 1, "services.data_server": 0, "jobgroup.local": 1}


def test_every_python_module_in_the_readme_answers_help():
    """Each `python -m MODULE [SUBCOMMAND]` exists and parses its --help (the flags a reader sees)."""
    checked = set()
    for command, _ in readme_commands():
        found = python_module(command)
        if found is None or found[0] == "pytest":
            continue
        module, args = found
        sub = args[: SUBCOMMANDS.get(module, 0)] if args and not args[0].startswith("-") else []
        if (module, *sub) in checked:
            continue
        checked.add((module, *sub))
        result = subprocess.run(
            [sys.executable, "-m", module, *sub, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, f"python -m {module} {' '.join(sub)} --help: {result.stderr[-2000:]}"
    assert {"trainer.main_ppo", "services.data_server", "jobgroup.local"} <= {m for m, *_ in checked}


def test_the_offline_trainer_commands_pass_the_config_checks(tmp_path):
    """The README's offline trainer command, after its export line, as written (HOME in a temp folder),
    with --dry-run: every key valid, every path there. Its hub twin is checked the same way offline."""
    env = {**os.environ, "HOME": str(tmp_path)}
    commands = [c for c, _ in readme_commands()]
    export = next(c for c in commands if "export synthetic-arith" in c)
    offline = [c for c in commands if "trainer.main_ppo" in c and "~/data/arith" in c]
    assert offline, "the README lost its offline trainer command"
    for command in [
        export,
        *(c.replace("trainer.main_ppo", "trainer.main_ppo --dry-run", 1) for c in offline),
    ]:
        run_as_written(command, env, timeout=120)


def run_as_written(command: str, env: dict[str, str], timeout: float) -> None:
    """Run a README command in bash from the repository root, `python` being this venv's interpreter."""
    shell = command.replace("python -m", f"{sys.executable} -m").replace("python -c", f"{sys.executable} -c")
    result = subprocess.run(
        ["bash", "-c", shell], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
