"""Settings shared by every service, read from env (one prefix per service) and CLI flags.

Precedence: CLI flag > environment variable > default. Each service subclasses `ServiceSettings`,
sets its own `env_prefix` (e.g. `DATA_SERVER_`) and adds its fields; `parse_cli` turns every field
into a `--flag` so the CLI can never drift from the typed model.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

S = TypeVar("S", bound="ServiceSettings")


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may run on: its affinity mask, capped by its cgroup's CPU quota (a
    container's `--cpus`, a Kubernetes CPU limit), neither of which os.cpu_count() sees: on a 64-core
    node a service limited to 2 CPUs would size its pools for 64."""
    cpus = len(os.sched_getaffinity(0))
    quota = cpu_quota(cgroup)
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def cpu_quota(cgroup: Path) -> float | None:
    """CPUs' worth of time the cgroup may use per period (cgroup v2 `cpu.max`, or v1's CFS quota);
    None where there is no limit or no such file."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SERVICE_", extra="forbid", validate_default=True)

    host: str = Field("0.0.0.0", description="Interface to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to bind (0 picks a free one).")
    auth_token: str | None = Field(
        None, description="Bearer token required on every route except /health; auth is off when unset."
    )
    max_request_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest request body accepted; larger ones get 413."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log threshold.")
    log_format: Literal["json", "text"] = Field("json", description="json: one JSON object per line.")
    graceful_shutdown_s: float = Field(
        10.0, ge=0, description="On SIGTERM, how long in-flight requests may take to finish."
    )
    keep_alive_s: float = Field(
        30.0,
        gt=0,
        description="How long an idle client connection stays open. Above uvicorn's 5 s, so a busy "
        "client rarely reuses a connection the server is closing that moment (a reset it must retry).",
    )


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_settings_arguments(parser: argparse.ArgumentParser, settings_cls: type[ServiceSettings]) -> None:
    """One `--flag` per settings field; values stay strings so pydantic does the validation."""
    for name, field in settings_cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = _unwrap_optional(field.annotation)
        helptext = (
            f"{field.description or ''} (env {settings_cls.model_config.get('env_prefix', '')}{name.upper()})"
        )
        if annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=helptext
            )
        elif typing.get_origin(annotation) in (list, tuple):
            parser.add_argument(flag, dest=name, nargs="+", default=None, help=helptext)
        else:
            parser.add_argument(flag, dest=name, default=None, help=helptext)


def settings_from_namespace(settings_cls: type[S], namespace: argparse.Namespace) -> S:
    """Build settings from parsed flags (unset flags fall back to env, then defaults).

    Invalid values end the process with one line naming the field, not a traceback.
    """
    given = {
        name: getattr(namespace, name)
        for name in settings_cls.model_fields
        if getattr(namespace, name, None) is not None
    }
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors()
        )
        sys.exit(f"error: invalid settings: {problems}")


def parse_cli(settings_cls: type[S], argv: list[str] | None = None, prog: str | None = None) -> S:
    parser = argparse.ArgumentParser(prog=prog, description=settings_cls.__doc__)
    add_settings_arguments(parser, settings_cls)
    return settings_from_namespace(settings_cls, parser.parse_args(argv))
