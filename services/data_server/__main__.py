"""python -m services.data_server [serve] --port 8000 ...   |   python -m services.data_server export gsm8k
--out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.common.settings import add_settings_arguments, settings_from_namespace


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    from services.common.app import serve
    from services.data_server import sources
    from services.data_server.app import DataServerSettings, create_app

    parser = argparse.ArgumentParser(
        prog="python -m services.data_server", description=DataServerSettings.__doc__
    )
    add_settings_arguments(parser, DataServerSettings)
    settings = settings_from_namespace(DataServerSettings, parser.parse_args(argv))
    try:
        for spec in settings.datasets or []:
            sources.precheck_spec(spec)
    except sources.DataSourceError as exc:
        sys.exit(f"error: {exc}")
    serve(create_app(settings), settings)


def export_main(argv: list[str]) -> None:
    from services.data_server import sources
    from services.data_server.export import write_verl_parquet

    parser = argparse.ArgumentParser(
        prog="python -m services.data_server export",
        description="Write train/test parquet with the schema of verl's examples/data_preprocess/gsm8k.py.",
    )
    parser.add_argument("dataset", choices=["gsm8k", "synthetic-arith"])
    parser.add_argument("--out", required=True, type=Path, help="Folder for train.parquet and test.parquet.")
    parser.add_argument(
        "--source",
        default=None,
        help="gsm8k: a folder/file of GSM8K jsonl or parquet (default: hub openai/gsm8k).",
    )
    parser.add_argument("--difficulty", default="easy", help="synthetic-arith: easy | medium | hard.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=8192, help="synthetic-arith train items.")
    parser.add_argument("--test-size", type=int, default=512, help="synthetic-arith test items.")
    args = parser.parse_args(argv)
    if args.dataset == "gsm8k":
        spec = f"gsm8k={args.source}" if args.source else "gsm8k=hub:openai/gsm8k"
    else:
        spec = f"synthetic-arith=synthetic-arith:{args.difficulty}"
    try:
        dataset = sources.load_spec(
            spec, seed=args.seed, synthetic_sizes={"train": args.train_size, "test": args.test_size}
        )
    except sources.DataSourceError as exc:
        sys.exit(f"error: {exc}")
    if dataset.kind not in ("gsm8k", "synthetic-arith"):
        sys.exit(f"error: {args.source} holds {dataset.kind} rows, not GSM8K question/answer rows")
    for split, rows in dataset.splits.items():
        path = args.out / f"{split}.parquet"
        write_verl_parquet(rows, path)
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
