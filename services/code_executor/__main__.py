"""python -m services.code_executor --port 8003 [--workers N] [--max-run-timeout-s S] ...

The sandbox is built and tried once, before the server binds its port: where it cannot run programs
(no user namespaces, no bubblewrap; not root without --shared-uid) the process exits non-zero with the
reason, and never runs code unsandboxed.
"""

from __future__ import annotations

import argparse
import sys

from services.common.settings import add_settings_arguments, settings_from_namespace


def main(argv: list[str] | None = None) -> None:
    from services.code_executor.app import CodeExecutorSettings, create_app, make_executor
    from services.code_executor.sandbox import SandboxUnavailable
    from services.common.app import serve

    parser = argparse.ArgumentParser(
        prog="python -m services.code_executor", description=CodeExecutorSettings.__doc__
    )
    add_settings_arguments(parser, CodeExecutorSettings)
    settings = settings_from_namespace(
        CodeExecutorSettings, parser.parse_args(sys.argv[1:] if argv is None else argv)
    )
    try:
        executor = make_executor(settings)
    except SandboxUnavailable as exc:
        sys.exit(f"error: {exc}")
    # uvloop (uvicorn's default) forks the whole server for every run, where the standard library's loop
    # would vfork; that loop made runs ~25% faster but hung now and then under the hostile test set
    # (BENCHMARKS.md, code-executor), so it stays uvloop until that is understood.
    serve(create_app(settings, executor), settings)


if __name__ == "__main__":
    main()
