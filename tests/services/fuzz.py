"""Schemathesis runs against the services' OpenAPI documents, on real processes on loopback.

Used by tests/services/test_fuzz_openapi.py (a short budget in CI) and bench/fuzz_services.py (the
longer run recorded in BENCHMARKS.md). `--checks all`: no 5xx, every status and body as documented,
schema-invalid requests refused with a 4xx, schema-valid ones accepted; tests/services/schemathesis.toml
says why 413 counts as a refusal.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.helpers import ROOT

CONFIG = Path(__file__).with_name("schemathesis.toml")
SERVICES = ("data-server", "reward-server", "retrieval-server", "code-executor")


def write_corpus(path: Path, passages: int = 200) -> Path:
    """A small corpus of made-up passages (Search-R1 rows) for a BM25 index: no model to load."""
    rows = [
        {"id": f"d{i}", "contents": f'"Topic {i}"\nTopic {i} is about item {i * 7 % 31} and place {i % 13}.'}
        for i in range(passages)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def build_bm25_index(folder: Path) -> Path:
    out = folder / "bm25"
    corpus = write_corpus(folder / "corpus.jsonl")
    command = ["build", "--corpus", str(corpus), "--out", str(out), "--index", "bm25", "--no-progress"]
    subprocess.run([sys.executable, "-m", "services.retrieval_server", *command], cwd=ROOT, check=True)
    return out


def service_args(service: str, index: Path | None = None) -> tuple[str, list[str]]:
    """(module, args) of a small but real configuration of each service."""
    if service == "data-server":
        return "services.data_server", [
            "--datasets",
            "synthetic-arith=synthetic-arith:easy",
            "--synthetic-train-size",
            "200",
            "--synthetic-test-size",
            "20",
        ]
    if service == "reward-server":
        return "services.reward_server", [
            "--math-workers",
            "1",
            "--math-timeout-s",
            "2",
            "--max-items",
            "256",
        ]
    if service == "code-executor":  # short runs and small batches: a fuzzed request is a real run
        return "services.code_executor", [
            "--workers",
            "2",
            "--max-run-timeout-s",
            "2",
            "--max-batch-runs",
            "8",
        ]
    if index is None:
        raise ValueError("the retrieval-server needs an index folder")
    return "services.retrieval_server", ["serve", "--index", str(index)]


@dataclass(frozen=True)
class FuzzResult:
    returncode: int
    output: str
    test_cases: int  # what schemathesis generated
    served: Counter  # the server's own count of answered requests, by status class ("2xx", "4xx", "5xx")

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and "No issues found" in self.output and not self.served["5xx"]

    def summary(self) -> str:
        lines = [line for line in self.output.splitlines() if line.strip()]
        return "\n".join(lines[-40:])


def served_by_status(url: str) -> Counter:
    """Requests the server answered, by status class, from its Prometheus counter."""
    counts: Counter = Counter()
    for status, value in re.findall(
        r'_requests_total\{[^}]*status="(\d+)"\} (\S+)', httpx.get(url + "/metrics").text
    ):
        counts[f"{status[0]}xx"] += int(float(value))
    return counts


def run_schemathesis(url: str, max_time_s: int, seed: int | None = None) -> FuzzResult:
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--no-color",
        "--config-file",
        str(CONFIG),
        "run",
        url + "/openapi.json",
        "--checks",
        "all",
        "--max-time",
        str(max_time_s),
        "--workers",
        "1",
        "--generation-database",
        "none",
        # A shared 2-core host can stall a process for seconds; a slow answer is not a contract failure.
        "--request-timeout",
        "60",
    ]
    if seed is not None:
        command += ["--seed", str(seed)]
    before = served_by_status(url)  # e.g. the 503s /health gave while the service was loading
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=max_time_s + 300, check=False
    )
    found = re.search(r"(\d+) generated", done.stdout)
    served = served_by_status(url)
    served.subtract(before)
    return FuzzResult(done.returncode, done.stdout + done.stderr, int(found.group(1)) if found else 0, served)
