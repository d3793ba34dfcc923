"""python -m services.reward_server --port 8001 [--reward-model PATH] [--judge-url URL] [--math-workers N]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.common.settings import add_settings_arguments, settings_from_namespace


def main(argv: list[str] | None = None) -> None:
    from services.common.app import serve
    from services.reward_server.app import RewardServerSettings, create_app

    parser = argparse.ArgumentParser(
        prog="python -m services.reward_server", description=RewardServerSettings.__doc__
    )
    add_settings_arguments(parser, RewardServerSettings)
    settings = settings_from_namespace(
        RewardServerSettings, parser.parse_args(sys.argv[1:] if argv is None else argv)
    )
    problem = missing_local_path(settings.reward_model)
    if problem:
        sys.exit(f"error: {problem}")
    serve(create_app(settings), settings)


def missing_local_path(model: str | None) -> str | None:
    """A --reward-model written as a local path (/x, ./x, ../x, ~/x) must exist; hub ids load later."""
    if model and model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
        return f"--reward-model {model} does not exist"
    return None


if __name__ == "__main__":
    main()
