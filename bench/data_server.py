"""data-server throughput: batches/s and p50/p99 latency for batch_size 256 at 1 and 16 concurrent clients.

    python bench/data_server.py [--gsm8k ../shared/data/gsm8k] [--seconds 10]

Starts a real server process (one uvicorn worker) on a free loopback port; each client walks its own
cursor chain with POST /v1/batches and parses every response, as the trainer does.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import SHARED_DATA, service_process


async def client_loop(
    url: str, dataset: str, batch_size: int, deadline: float, latencies: list[float]
) -> None:
    cursor = None
    async with httpx.AsyncClient(timeout=30) as http:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            response = await http.post(
                url + "/v1/batches", json={"dataset": dataset, "batch_size": batch_size, "cursor": cursor}
            )
            body = response.json()
            latencies.append(time.perf_counter() - start)
            assert response.status_code == 200 and len(body["items"]) == batch_size, response.text[:200]
            cursor = body["next_cursor"]


async def measure(url: str, dataset: str, batch_size: int, clients: int, seconds: float) -> dict:
    await client_loop(url, dataset, batch_size, time.perf_counter() + 1.0, [])  # warm-up
    latencies: list[float] = []
    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(
        *(client_loop(url, dataset, batch_size, deadline, latencies) for _ in range(clients))
    )
    elapsed = time.perf_counter() - start
    ordered = sorted(latencies)
    return {
        "clients": clients,
        "batches": len(latencies),
        "batches_per_s": len(latencies) / elapsed,
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gsm8k", type=Path, default=SHARED_DATA / "gsm8k")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    if (args.gsm8k / "train.jsonl").exists():
        dataset, spec = "gsm8k", [f"gsm8k={args.gsm8k}"]
    else:
        dataset, spec = "synthetic-arith", ["synthetic-arith=synthetic-arith:easy"]
    with service_process("services.data_server", "--datasets", *spec, "--log-level", "warning") as (url, _):
        print(f"dataset={dataset} batch_size={args.batch_size} seconds={args.seconds}")
        print(f"{'clients':>8} {'batches':>8} {'batches/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
        for clients in (1, 16):
            row = asyncio.run(measure(url, dataset, args.batch_size, clients, args.seconds))
            print(
                f"{row['clients']:>8} {row['batches']:>8} {row['batches_per_s']:>10.1f} "
                f"{row['p50_ms']:>8.1f} {row['p99_ms']:>8.1f}"
            )


if __name__ == "__main__":
    main()
