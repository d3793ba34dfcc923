"""A longer schemathesis run (`--checks all`) of each service's OpenAPI document, on real processes.

The CI test (tests/services/test_fuzz_openapi.py) gives each service 12 s; this gives each
`--seconds` (default 300) and reports, per service: the test cases schemathesis generated, the
requests the server itself counted by status class (from its /metrics: 5xx must be 0), and the
contract failures schemathesis found (must be 0). The retrieval-server serves a flat MiniLM index of
SQuAD when ../shared/data is here (the embedder's tokenizer sees the fuzzed text), else BM25.

    .venv/bin/python bench/fuzz_services.py [--seconds 300] [--service data-server ...]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.retrieval_server import WIKI, ensure_index  # noqa: E402
from tests.helpers import service_process  # noqa: E402
from tests.services.fuzz import SERVICES, build_bm25_index, run_schemathesis, service_args  # noqa: E402


def retrieval_index(work_dir: Path) -> Path:
    if (WIKI / "squad_dev_corpus.jsonl").exists():
        return ensure_index(work_dir)
    return build_bm25_index(Path(tempfile.mkdtemp()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=300, help="schemathesis time budget per service")
    parser.add_argument("--service", action="append", choices=SERVICES, help="default: all four")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/retrieval_bench"))
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    rows = []
    for service in args.service or SERVICES:
        index = retrieval_index(args.work_dir) if service == "retrieval-server" else None
        module, service_flags = service_args(service, index)
        load_before = os.getloadavg()[0]
        with service_process(module, *service_flags, "--log-level", "error", timeout_s=300) as (url, _):
            result = run_schemathesis(url, args.seconds, seed=args.seed)
        failures = re.search(r"(\d+) failures?", result.output)
        rows.append(
            {
                "service": service,
                "test_cases": result.test_cases,
                "served": sum(v for v in result.served.values() if v > 0),
                "2xx": result.served["2xx"],
                "4xx": result.served["4xx"],
                "5xx": result.served["5xx"],
                "failures": int(failures.group(1)) if failures and result.returncode else 0,
                "clean": result.clean,
                "load": f"{load_before:.1f}-{os.getloadavg()[0]:.1f}",
            }
        )
        print(rows[-1], flush=True)
        if not result.clean:
            print(result.summary())
    print(f"\n{os.cpu_count()} cores; schemathesis --checks all, {args.seconds} s per service")
    print("| service | test cases | requests served | 2xx | 4xx | 5xx | contract failures | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['service']} | {r['test_cases']} | {r['served']} | {r['2xx']} | {r['4xx']} | {r['5xx']} "
            f"| {r['failures']} | {r['load']} |"
        )


if __name__ == "__main__":
    main()
