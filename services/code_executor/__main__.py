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
    # The standard library's loop, not uvloop: its subprocesses start with vfork (subprocess.Popen),
    # where uvloop forks the whole server, page tables and all, for every run: 2.9 ms of the server's
    # CPU a run against 4.8-8.7 ms, and 0.52 of bare subprocess's runs/s against 0.41 (BENCHMARKS.md).
    serve(create_app(settings, executor), settings, loop="asyncio")


if __name__ == "__main__":
    main()
