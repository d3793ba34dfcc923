"""Throughput and latency of the retrieval-server under concurrent clients, as a trainer loads it.

Starts `python -m services.retrieval_server serve` on a flat MiniLM index of the SQuAD dev corpus
(../shared/data/wiki; built once into --work-dir), then, for 1, 8, 32 and 64 concurrent clients
that each send one question per request, back to back, reports queries/s and p50/p99 latency; then
the same with requests of 64 questions. The mean micro-batch size comes from the server's /metrics.
The clients run in this process (aiohttp when installed, else httpx) and share the cores with the
server, as a co-located trainer would. On a shared machine the server gets what others leave, so
each phase also reports the CPU the server process used (cores) and queries per server CPU-second,
which says what the same code does with the cores to itself.

Issue 10's aims, checked at the end: >= 300 queries/s at 32 one-query clients with p99 < 250 ms; at 64
clients no less throughput than at 32 and p99 < 500 ms. `--only-aims` runs just those two phases.

    .venv/bin/python bench/retrieval_server.py [--seconds 10] [--only-aims] [--work-dir /tmp/retrieval_bench]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WIKI = ROOT.parent / "shared" / "data" / "wiki"

from tests.helpers import free_port, stop_process, wait_healthy


def ensure_index(work_dir: Path, kind: str = "flat") -> Path:
    out = work_dir / f"squad_{kind}"
    if not (out / "manifest.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "services.retrieval_server",
                "build",
                "--corpus",
                str(WIKI / "squad_dev_corpus.jsonl"),
                "--out",
                str(out),
                "--index",
                kind,
                "--overwrite",
            ],
            cwd=ROOT,
            check=True,
        )
    return out


def questions(limit: int) -> list[str]:
    with (WIKI / "squad_dev_qa.jsonl").open() as handle:
        return [json.loads(line)["question"] for _, line in zip(range(limit), handle)]


class Poster:
    """POST JSON with aiohttp if present (lighter per request than httpx), else httpx."""

    def __init__(self, url: str, connections: int) -> None:
        self.url = url + "/retrieve"
        try:
            import aiohttp

            self._aiohttp = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections))
            self._httpx = None
        except ImportError:
            self._aiohttp = None
            self._httpx = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=connections))

    async def post(self, payload: dict) -> None:
        if self._aiohttp is not None:
            async with self._aiohttp.post(self.url, json=payload) as response:
                body = await response.read()
                assert response.status == 200, body[:200]
        else:
            response = await self._httpx.post(self.url, json=payload)
            assert response.status_code == 200, response.text[:200]

    async def close(self) -> None:
        if self._aiohttp is not None:
            await self._aiohttp.close()
        else:
            await self._httpx.aclose()


async def load_phase(url: str, clients: int, per_request: int, seconds: float, pool: list[str]) -> dict:
    poster = Poster(url, clients)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def client() -> None:
        while time.perf_counter() < deadline:
            start = next(counter) * per_request
            batch = [pool[(start + i) % len(pool)] for i in range(per_request)]
            sent = time.perf_counter()
            await poster.post({"queries": batch, "topk": 3, "return_scores": True})
            latencies.append(time.perf_counter() - sent)

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - began
    await poster.close()
    latencies.sort()
    return {
        "clients": clients,
        "queries_per_request": per_request,
        "requests": len(latencies),
        "queries_per_s": round(len(latencies) * per_request / elapsed, 1),
        "p50_ms": round(1e3 * statistics.median(latencies), 1),
        "p99_ms": round(1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1),
    }


def batch_stats(url: str) -> tuple[float, float]:
    """(embed calls, queries embedded) so far, from the server's batch-size histogram."""
    text = httpx.get(url + "/metrics").text
    count = float(re.search(r"^retrieval_server_batch_queries_count (\S+)$", text, re.MULTILINE).group(1))
    total = float(re.search(r"^retrieval_server_batch_queries_sum (\S+)$", text, re.MULTILINE).group(1))
    return count, total


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ALL_PHASES = [(1, 1), (8, 1), (32, 1), (64, 1), (1, 64), (4, 64)]
AIM_PHASES = [(32, 1), (64, 1)]


def aims_verdict(rows: list[dict]) -> str:
    by_clients = {r["clients"]: r for r in rows if r["queries_per_request"] == 1}
    if 32 not in by_clients or 64 not in by_clients:
        return "aims not measured (need the 32- and 64-client phases)"
    at32, at64 = by_clients[32], by_clients[64]
    checks = [
        (f"32 clients: {at32['queries_per_s']} q/s >= 300", at32["queries_per_s"] >= 300),
        (f"32 clients: p99 {at32['p99_ms']} ms < 250", at32["p99_ms"] < 250),
        (
            f"64 clients: {at64['queries_per_s']} q/s >= {at32['queries_per_s']} (32 clients)",
            at64["queries_per_s"] >= at32["queries_per_s"],
        ),
        (f"64 clients: p99 {at64['p99_ms']} ms < 500", at64["p99_ms"] < 500),
    ]
    return "\n".join(f"{'met' if ok else 'NOT met'}: {text}" for text, ok in checks)


def run_phases(url: str, pid: int, seconds: float, pool: list[str], plan=ALL_PHASES) -> list[dict]:
    rows = []
    for clients, per_request in plan:
        asyncio.run(load_phase(url, clients, per_request, 1.0, pool))  # warm the connections
        calls_before, queries_before = batch_stats(url)
        cpu_before, began = cpu_seconds(pid), time.perf_counter()
        row = asyncio.run(load_phase(url, clients, per_request, seconds, pool))
        server_cores = (cpu_seconds(pid) - cpu_before) / (time.perf_counter() - began)
        calls, queries = batch_stats(url)
        row["mean_batch_queries"] = round((queries - queries_before) / max(1.0, calls - calls_before), 1)
        row["server_cores"] = round(server_cores, 2)
        row["queries_per_server_cpu_s"] = round(row["queries_per_s"] / max(server_cores, 1e-9))
        row["load_avg_1m"] = round(os.getloadavg()[0], 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="Duration of each phase.")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/retrieval_bench"))
    parser.add_argument(
        "--index", type=Path, default=None, help="Serve this index folder instead of building one."
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="Extra serve flag, e.g. --max-wait-ms=5."
    )
    parser.add_argument("--only-aims", action="store_true", help="Only the 32- and 64-client phases.")
    args = parser.parse_args()
    if args.index is None and not (WIKI / "squad_dev_corpus.jsonl").exists():
        sys.exit(f"error: {WIKI} is not here; pass --index DIR")
    index = args.index or ensure_index(args.work_dir)
    pool = questions(2000)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.retrieval_server",
            "serve",
            "--index",
            str(index),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *args.server_arg,
        ],
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 180, server)
        print(json.dumps({"health": httpx.get(url + "/health").json(), "server_args": args.server_arg}))
        rows = run_phases(url, server.pid, args.seconds, pool, AIM_PHASES if args.only_aims else ALL_PHASES)
    finally:
        stop_process(server)
    print(f"\n{os.cpu_count()} cores; load average {os.getloadavg()}")
    print(
        "| clients | queries/request | queries/s | p50 ms | p99 ms | mean batch (queries) | server cores "
        "| queries per server CPU-s | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['clients']} | {r['queries_per_request']} | {r['queries_per_s']} | {r['p50_ms']} | "
            f"{r['p99_ms']} | {r['mean_batch_queries']} | {r['server_cores']} "
            f"| {r['queries_per_server_cpu_s']} "
            f"| {r['load_avg_1m']} |"
        )
    print(aims_verdict(rows))


if __name__ == "__main__":
    main()
