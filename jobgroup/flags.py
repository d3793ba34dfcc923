"""On/off environment variables, read the same way by every launcher (jobgroup/scripts/flag.sh in bash)."""

from __future__ import annotations

import os

TRUE = frozenset({"true", "1", "yes", "on"})
FALSE = frozenset({"false", "0", "no", "off", ""})


def parse_flag(name: str, value: str | None) -> bool:
    """true/1/yes/on -> True; false/0/no/off/empty/None -> False; anything else is a ValueError."""
    word = (value or "").strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"{name}={value} is not a flag: use true/false, 1/0 or yes/no")


def env_flag(name: str, environ: dict[str, str] | None = None) -> bool | None:
    """The flag in the environment, or None when the variable is unset."""
    env = os.environ if environ is None else environ
    return None if name not in env else parse_flag(name, env[name])
