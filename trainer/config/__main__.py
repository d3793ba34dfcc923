"""python -m trainer.config --markdown | [key=value ...]

--markdown prints the configuration reference (docs/config.md); otherwise the resolved config of the
given command line is printed (or its problems, exit code 2).
"""

from __future__ import annotations

import sys

from trainer.config.cli import ConfigError, load_config
from trainer.config.reference import config_reference_markdown


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--markdown"]:
        print(config_reference_markdown(), end="")
        return 0
    try:
        config = load_config(argv)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    print(config.resolved_yaml(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
