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
    # The standard library's loop, not uvloop (uvicorn's "auto"): uvloop forks the whole server for every
    # run, where this loop vforks, and runs are ~25% faster (BENCHMARKS.md, code-executor). The hangs it
    # once had under the hostile test set were a stream left unread past its output limit: there a
    # `process.wait()` begun before the exit also waits for every pipe to end (CPython gh-119710), and
    # an unread pipe pauses and never ends; `sandbox.read_capped` now reads each stream to its end.
    serve(create_app(settings, executor), settings, loop="asyncio")


if __name__ == "__main__":
    main()
