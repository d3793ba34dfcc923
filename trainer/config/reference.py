"""The configuration reference (docs/config.md): one table per section, generated from the schema.

python -m trainer.config --markdown     prints it; tests/unit/test_readme.py keeps docs/config.md equal
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import yaml

from trainer.config.accepted import NO_EFFECT_KEYS
from trainer.config.run import Config
from trainer.config.schema import Section


def type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " / ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is tuple:
        return f"[{', '.join(type_name(a) for a in args)}]"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _default_text(field: Any, value: Any) -> str:
    extra = field.json_schema_extra or {}
    if "env" in extra:
        return f"`${extra['env']}`, else `{extra['fallback']}`"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return str(value)


def _rows(section: Section, prefix: str) -> list[str]:
    rows = []
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, Section):
            rows += _rows(value, f"{prefix}{name}.")
            continue
        cells = [
            f"`{prefix}{name}`",
            type_name(field.annotation).replace("|", "\\|"),
            _default_text(field, value),
            (field.description or "").replace("|", "\\|"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


HEADER = """\
# Configuration reference

Every key of `python -m trainer.main_ppo key=value ...` that changes what the trainer does, with its
type, default and meaning (generated from `trainer/config/`; `python -m trainer.config --markdown`
prints it). Keys and values are verl's; the command line is read as verl reads it (Hydra overrides,
OmegaConf YAML and `${...}` interpolation): see `trainer/config/cli.py`. A default written
`null: <rule>` is filled in when the config is built, so `--dry-run` prints what runs."""


def _no_effect_paragraph() -> list[str]:
    entries = ", ".join(f"`{key}`" for key in sorted(NO_EFFECT_KEYS))
    return [
        "",
        "## verl keys accepted with no effect",
        "",
        "These verl keys (each with everything under it) are accepted so verl scripts run unchanged; they",
        'change nothing here, and a run that sets one says so once at start ("accepted, no effect here:',
        '..."). Any other unknown key is an error naming the closest valid one.',
        "",
        entries,
    ]


def config_reference_markdown() -> str:
    """The reference: key, type, default and description, one table per top-level section."""
    raw = Config()  # not derived (trainer/config/derive.py): "null: <rule>" defaults show as null
    lines = [HEADER]
    for name, field in Config.model_fields.items():
        lines += [
            "",
            f"## {name}",
            "",
            field.description or "",
            "",
            "| key | type | default | description |",
            "|---|---|---|---|",
        ]
        lines += _rows(getattr(raw, name), f"{name}.")
    return "\n".join(lines + _no_effect_paragraph()) + "\n"
