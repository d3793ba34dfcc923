"""python -m services.retrieval_server [serve] --index DIR --port 8002 | ... build --corpus F --out DIR"""

from __future__ import annotations

import argparse
import sys

from services.common.settings import add_settings_arguments, settings_from_namespace


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["build"]:
        from services.retrieval_server.build import main as build_main

        return build_main(argv[1:])
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    from services.retrieval_server.app import RetrievalServerSettings

    parser = argparse.ArgumentParser(
        prog="python -m services.retrieval_server [serve]", description=RetrievalServerSettings.__doc__
    )
    add_settings_arguments(parser, RetrievalServerSettings)
    settings = settings_from_namespace(RetrievalServerSettings, parser.parse_args(argv))
    precheck(settings)
    from services.common.app import serve
    from services.retrieval_server.app import create_app

    serve(create_app(settings), settings)


def precheck(settings) -> None:
    """Fail in one line, before the server or the model starts, on what the manifest alone shows."""
    from services.retrieval_server.store import ManifestError, check_embedder_name, read_manifest

    if settings.index is None:
        sys.exit("error: no index folder given (--index DIR or RETRIEVAL_SERVER_INDEX)")
    try:
        check_embedder_name(read_manifest(settings.index), settings.embedder)
    except ManifestError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
