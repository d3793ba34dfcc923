"""From a verl command line to a validated Config: YAML files, then Hydra overrides, then the schema.

    config = load_config(["--config", "run.yaml", "algorithm.adv_estimator=grpo", "+trainer.val_only=true"])

The syntax is verl's, read by verl's own libraries: each override is parsed by Hydra's override parser
(what `python -m verl.trainer.main_ppo` runs), YAML files are loaded and merged by OmegaConf, and `${...}`
interpolation (`${trainer.project_name}`, `${oc.env:VAR,default}`, `${oc.select:key,default}`) is
resolved by OmegaConf against the whole tree, defaults included. So:

    key=value     sets a key; values are Hydra's: 1e-6, true, null, [a,b], {k: v}, 'quoted text'
    +key=value    sets a key too (Hydra refuses + for a key that exists; verl's key set moves between
    ++key=value   versions, so both are accepted here for every key)
    ~key          drops what a YAML file or an earlier override set: the default applies (~key=value: only
                  when the current value is value)
    a,b           is a Hydra sweep, refused as in verl: write [a,b] for a list or 'a,b' for text

Two courtesies beyond Hydra: a value starting with `~` (`~/data/x.parquet`) is read as a path, not a
syntax error, and the text `None` on a nullable key means null. Unknown keys are errors naming the
closest valid key; verl keys with no effect here (trainer/config/accepted.py) are taken out and
reported. Pydantic then types and bounds every value.

Both of verl's reward layouts are read: the one the schema keeps (`custom_reward_function.*`,
`reward_model.*`) and verl 0.7's `reward.*` (with a top-level `sandbox_fusion`), whose keys are moved to
the schema's (REWARD_LAYOUT) as verl 0.7 moves the old ones the other way. A value left `???` (OmegaConf's
"must be set", as in verl's generated config) leaves the default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from trainer.config import checks, derive, keys
from trainer.config.accepted import is_no_effect, pop_no_effect
from trainer.config.run import Config


class ConfigError(ValueError):
    """Bad configuration: one problem per line, each naming the keys involved."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


# ---------------------------------------------------------------------------------------- verl 0.7's keys

# verl 0.7's reward keys -> the schema's (verl's `migrate_legacy_reward_impl` maps them the other way);
# the longest matching prefix wins
REWARD_LAYOUT = {
    "reward.custom_reward_function": "custom_reward_function",
    "reward.sandbox_fusion": "reward_model.sandbox_fusion",
    "sandbox_fusion": "reward_model.sandbox_fusion",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_model": "reward_model",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_manager.source": "reward_model.reward_loop_source",
    "reward.reward_manager.module.path": "reward_model.reward_loop_module_path",
    "reward.reward_manager.module.name": "reward_model.reward_loop_class_name",
    "reward.reward_kwargs": "reward_model.reward_kwargs",
    "reward.num_workers": "reward_model.num_workers",
}
MISSING = "???"


def schema_key(key: str) -> str:
    """The schema's name for a key of verl 0.7's reward layout; any other key as it is."""
    for old in sorted(REWARD_LAYOUT, key=len, reverse=True):
        if key == old or key.startswith(old + "."):
            return REWARD_LAYOUT[old] + key[len(old) :]
    return key


def adopt_reward_layout(tree: dict) -> list[str]:
    """Move the `reward` and `sandbox_fusion` subtrees of a YAML tree to the schema's keys, in place.

    A value the schema's own key already holds wins over a null (verl's rule); two different values are a
    problem naming both keys."""
    problems = []
    for top in ("reward", "sandbox_fusion"):
        subtree = tree.pop(top, None)
        if not isinstance(subtree, dict):
            if subtree is not None:
                tree[top] = subtree  # not verl's layout: check_keys names it
            continue
        for key, value in _leaves(subtree, top):
            target = schema_key(key)
            parent = tree
            *path, leaf = target.split(".")
            for part in path:
                parent = parent.setdefault(part, {})
            held = parent.get(leaf)
            if held is not None and value is not None and held != value:
                problems.append(f"{key}={value!r} and {target}={held!r}: set one of the two")
            elif held is None:
                parent[leaf] = value
    return problems


def _leaves(node: dict, prefix: str):
    for name, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}", value


def drop_missing(node: dict) -> None:
    """Take out every `???` value (verl's generated config leaves the mandatory ones so): defaults apply."""
    for name in list(node):
        if isinstance(node[name], dict):
            drop_missing(node[name])
        elif node[name] == MISSING:
            del node[name]


# ---------------------------------------------------------------------------------------- the command line


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(YAML files, override texts) from `--config F`, `--config=F`, `config=F` and the rest."""
    files, overrides, problems = [], [], []
    items = iter(argv)
    for item in items:
        name, sep, value = item.partition("=")
        if item == "--config":
            file = next(items, None)
            files.append(file) if file else problems.append("--config needs a file")
        elif name in ("--config", "config") and sep:
            files.append(value)
        elif name in ("--config-path", "--config-name", "-cp", "-cn"):
            problems.append(f"{name}: Hydra config groups are not supported; give a file: --config FILE")
        else:
            overrides.append(item)
    if problems:
        raise ConfigError(problems)
    return files, overrides


_PARSER = OverridesParser.create()


def parse_override(text: str) -> tuple[Override | None, str | None]:
    """(the parsed Hydra override, None) or (None, the problem)."""
    key, sep, value = text.partition("=")
    if not sep and not text.startswith("~"):
        return None, f"expected key=value, got {text!r}"
    if sep and value.startswith("~") and "'" not in value:
        text = f"{key}='{value}'"  # a home path; Hydra's grammar has no bare ~ in values
    try:
        override = _PARSER.parse_override(text)
    except HydraException as exc:
        detail = str(exc).strip().splitlines()[0]
        return None, f"cannot read {text!r} ({detail}); expected key=value, +key=value or ~key"
    if override.value_type is None and override.type is not OverrideType.DEL:
        return None, f"expected key=value, got {text!r}"
    if override.is_sweep_override():
        return None, (
            f"{key}: {value!r} is a Hydra sweep, not a value: write {key}=[{value}] for a list, "
            f"or {key}='{value}' for text"
        )
    return override, None


# ---------------------------------------------------------------------------------------- YAML


def _drop_targets(node: Any) -> Any:
    """verl's YAML files name dataclasses in `_target_` keys; they mean nothing here."""
    if isinstance(node, dict):
        return {str(k): _drop_targets(v) for k, v in node.items() if k != "_target_"}
    if isinstance(node, list):
        return [_drop_targets(v) for v in node]
    return node


def read_yaml_config(path: str) -> DictConfig:
    file = Path(path).expanduser()
    try:
        loaded = OmegaConf.load(file)
    except OSError as exc:
        raise ConfigError([f"config file {path}: {exc.strerror or exc}"]) from None
    except Exception as exc:  # yaml.YAMLError and OmegaConf's own errors
        raise ConfigError([f"config file {path}: not valid YAML: {str(exc).splitlines()[0]}"]) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError([f"config file {path}: expected a mapping of keys at the top, got a list"])
    return OmegaConf.create(_drop_targets(OmegaConf.to_container(loaded, resolve=False)))


# ---------------------------------------------------------------------------------------- overrides


def _typed_value(override: Override, text: str, key: str) -> Any:
    """Hydra's value, except that a text key keeps the text as written (`experiment_name=007`)."""
    value = override.value()
    if isinstance(value, (bool, int, float)):
        found = keys.field_at(key.split("."))
        if found is not None and not found[1] and found[0] in (str, str | None):
            return text.partition("=")[2].strip()
    return value


def _current(tree: DictConfig, defaults: dict, key: str) -> Any:
    value = OmegaConf.select(tree, key, default=None, throw_on_resolution_failure=False)
    if value is None:
        value = defaults
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
    return OmegaConf.to_container(value) if isinstance(value, DictConfig) else value


def _delete(tree: DictConfig, override: Override, defaults: dict, key: str) -> str | None:
    if not is_no_effect(key) and keys.field_at(key.split(".")) is None:
        return keys.unknown_key_message(key)
    if override.value_type is not None:
        current = _current(tree, defaults, key)
        if current != override.value():
            return f"~{key}={override.get_value_element_as_str()}: its value is {current!r}, not that"
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(tree, parent_key) if parent_key else tree
    if isinstance(parent, DictConfig) and leaf in parent:
        del parent[leaf]
    return None


def apply_override(tree: DictConfig, text: str, defaults: dict) -> str | None:
    """Apply one override to the user's tree; the problem when it cannot be applied."""
    override, problem = parse_override(text)
    if override is None:
        return problem
    key = schema_key(override.key_or_group)
    if override.type is OverrideType.DEL:
        return _delete(tree, override, defaults, key)
    value = _typed_value(override, text, key)
    problem = keys.key_problem(key, value)
    if problem is None:
        try:
            OmegaConf.update(tree, key, value, merge=True, force_add=True)
        except OmegaConfBaseException:  # a map given where a list was (or the reverse): the new one wins
            OmegaConf.update(tree, key, value, merge=False, force_add=True)
    return problem


# ---------------------------------------------------------------------------------------- the whole load


def _validation_messages(exc: ValidationError) -> list[str]:
    messages = []
    for error in exc.errors():
        # Drop pydantic's union-member tags ('list[str]', 'function-after[...]') from the location.
        parts = [str(p) if not isinstance(p, int) else f"[{p}]" for p in error["loc"] if "[" not in str(p)]
        where = ".".join(parts).replace(".[", "[")
        message = error["msg"].removeprefix("Value error, ")
        given = error.get("input")
        shown = "" if isinstance(given, (dict, BaseModel)) or not where else f" (got {given!r})"
        messages.append(f"{where}: {message}{shown}" if where else message)
    return messages


def overlay(base: dict, extra: dict) -> dict:
    """`extra` over `base`: maps merge key by key, anything else is replaced (a list is not merged)."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = overlay(merged[key], value)
        else:
            merged[key] = value
    return merged


def resolve(user: dict, defaults: dict) -> dict:
    """The user's tree over the defaults, every `${...}` resolved by OmegaConf."""
    try:
        return OmegaConf.to_container(OmegaConf.create(overlay(defaults, user)), resolve=True)
    except OmegaConfBaseException as exc:
        where = f"{exc.full_key}: " if getattr(exc, "full_key", None) else ""
        raise ConfigError([f"{where}{str(exc).splitlines()[0]}"]) from None


def load_config(argv: list[str], *, check: bool = True) -> Config:
    """Parse YAML files and overrides (a verl command line) into a validated Config.

    Raises ConfigError listing every problem: unknown keys (with the closest valid ones), bad values,
    and with check=True what stops a run (trainer/config/checks.py).
    """
    files, overrides = split_argv(argv)
    # every default, `null: <rule>` values still null (not derived yet): what `${...}` can point at
    defaults = Config().model_dump(mode="json")
    merged: dict = {}
    problems = []
    for file in files:
        loaded = OmegaConf.to_container(read_yaml_config(file), resolve=False)
        problems += adopt_reward_layout(loaded)
        merged = overlay(merged, loaded)
    tree = OmegaConf.create(merged)
    problems += [p for text in overrides if (p := apply_override(tree, text, defaults))]
    user = OmegaConf.to_container(tree, resolve=False)
    drop_missing(user)
    no_effect = pop_no_effect(user)
    problems += keys.check_keys(user)
    resolved = resolve(user, defaults)
    keys.nulls_from_none_text(resolved)
    try:
        config = Config.model_validate(resolved)
        conflicts = derive.deprecated_conflicts(config)  # before derive fills the current key of a pair
        derive.fill_derived(config)
    except ValidationError as exc:
        raise ConfigError(problems + _validation_messages(exc)) from None
    except ValueError as exc:  # a derived value that cannot be had (a `${...}` naming no key)
        raise ConfigError([*problems, str(exc)]) from None
    config._no_effect = sorted(set(no_effect))
    if check:
        problems += conflicts + checks.problems(config)
    if problems:
        raise ConfigError(problems)
    return config
