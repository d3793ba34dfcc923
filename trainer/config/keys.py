"""The key tree of the schema: which dotted keys exist, what type each has, the closest one to a typo."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from trainer.config.accepted import NO_EFFECT_KEYS, is_no_effect
from trainer.config.run import Config
from trainer.config.schema import Section


def section_type(annotation: Any) -> type[Section] | None:
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    return None


def is_open_mapping(annotation: Any) -> bool:
    """dict-typed fields (apply_chat_template_kwargs) take any keys."""
    return typing.get_origin(annotation) is dict


def config_keys(model: type[Section] = Config, prefix: str = "") -> list[str]:
    """Every dotted key (sections and values) of the schema."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        sub = section_type(field.annotation)
        if sub is not None:
            keys += config_keys(sub, f"{prefix}{name}.")
    return keys


def field_at(path: list[str]) -> tuple[Any, bool] | None:
    """(annotation, inside_open_mapping) of the field at `path`; None when the path is not a key.

    inside_open_mapping is True at or below a dict-typed field, whose entries have no declared type.
    """
    model: type[Section] | None = Config
    annotation = None
    for part in path:
        field = model.model_fields.get(part) if model else None
        if field is None:
            return None
        if is_open_mapping(field.annotation):
            return field.annotation, True
        annotation, model = field.annotation, section_type(field.annotation)
    return annotation, False


def unknown_key_message(key: str) -> str:
    """`unknown key 'x'; did you mean 'y'?` naming the closest valid keys.

    Candidates are scored on the whole dotted path and on the last name alone (a key put in the wrong
    section); only those nearly as close as the best one are named.
    """
    leaf = key.rpartition(".")[2]

    def score(candidate: str) -> float:
        whole = difflib.SequenceMatcher(None, key, candidate).ratio()
        last = difflib.SequenceMatcher(None, leaf, candidate.rpartition(".")[2]).ratio()
        return max(whole, last - 0.05)

    scored = sorted(((score(k), k) for k in [*config_keys(), *NO_EFFECT_KEYS]), reverse=True)
    best = scored[0][0]
    guesses = [k for s, k in scored[:3] if s >= max(0.75, best - 0.02)]
    if not guesses:
        return f"unknown key '{key}' (docs/config.md lists every key)"
    quoted = [f"'{g}'" for g in guesses]
    alternatives = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"unknown key '{key}'; did you mean {alternatives}?"


def section_message(path: str, sub: type[Section]) -> str:
    example = next(iter(sub.model_fields))
    return f"'{path}' is a section, not a value: set its keys, e.g. '{path}.{example}=...'"


def key_problem(key: str, value: Any) -> str | None:
    """Why `key=value` cannot be set (an unknown key, a value for a section); None when it can."""
    if is_no_effect(key):
        return None
    found = field_at(key.split("."))
    if found is None:
        return unknown_key_message(key)
    sub = section_type(found[0]) if not found[1] else None
    if sub is not None and not isinstance(value, dict):
        return section_message(key, sub)
    return None


def check_keys(tree: dict, model: type[Section] = Config, prefix: str = "") -> list[str]:
    """Unknown keys and values given where a section belongs (from YAML files), each with a fix.

    The offending entries are removed from `tree`, so the rest can still be validated and every
    problem reported in one go.
    """
    problems = []
    for key, value in list(tree.items()):
        path = f"{prefix}{key}"
        field = model.model_fields.get(str(key))
        sub = section_type(field.annotation) if field is not None else None
        if field is None:
            problems.append(unknown_key_message(path))
            del tree[key]
        elif sub is not None and isinstance(value, dict):
            problems += check_keys(value, sub, f"{path}.")
        elif sub is not None:
            problems.append(section_message(path, sub))
            del tree[key]
    return problems


def nulls_from_none_text(tree: dict, model: type[Section] = Config) -> None:
    """The text `None` on a nullable key means null (Hydra reads it as text; verl users mean null)."""
    for key, value in tree.items():
        field = model.model_fields.get(str(key))
        if field is None or is_open_mapping(field.annotation):
            continue
        sub = section_type(field.annotation)
        if sub is not None and isinstance(value, dict):
            nulls_from_none_text(value, sub)
        elif value == "None" and type(None) in typing.get_args(field.annotation):  # `x | None`
            tree[key] = None
