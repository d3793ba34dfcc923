"""Good clients' latency with and without one hostile client in the mix (issue 10's acceptance run).

For each service, two runs of `--seconds` each against a fresh server process:
  baseline: `--clients - 1` good clients, back to back;
  hostile:  the same good clients plus one client that sends the inputs that used to take a server
            down (below), each in its own request, every input in its own loop.
Reported: the good clients' requests, failures (any non-200 or transport error), p50/p99 latency and
throughput, the hostile client's statuses, and the load average (the machine may be shared). The aim:
no good request fails and the good p99 with the hostile client stays within 2x of the baseline.

reward-server: good = 256 GSM8K answers per POST /v1/rewards. Hostile = one QA answer of 262,144
  characters of open <answer> tags; 6 math items that hang sympy; a 53 MB body of 1e6 items; options
  that overflow (1e308); a client that sends hanging math items and hangs up after 1 s.
retrieval-server: good = one SQuAD question per POST /retrieve (top 3, flat MiniLM index). Hostile =
  1,000 queries of 4,000 characters; a lone surrogate; a 5 MB body.

    .venv/bin/python bench/hostile_clients.py [--service reward|retrieval|both] [--seconds 30] [--clients 64]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.retrieval_server import ensure_index, questions  # noqa: E402
from tests.helpers import SHARED_DATA, free_port, stop_process, wait_healthy  # noqa: E402

HANG = "\\boxed{9^{9^{9^{9}}}}"


def gsm8k_items(n: int) -> list[dict]:
    path = SHARED_DATA / "gsm8k" / "test.jsonl"
    if path.exists():
        answers = [json.loads(line)["answer"] for line in path.read_text().splitlines()[:n]]
    else:
        answers = [f"step by step #### {i}" for i in range(n)]
    return [
        {
            "data_source": "openai/gsm8k",
            "response": a,
            "ground_truth": a.rsplit("#### ", 1)[-1].replace(",", ""),
        }
        for a in answers
    ]


def reward_inputs() -> tuple[Callable[[int], bytes], list[tuple[str, bytes, float]]]:
    """(good body for client i, [(name, hostile body, client timeout s)])."""
    items = gsm8k_items(1024)
    goods = [
        orjson.dumps({"items": [items[(i * 256 + k) % len(items)] for k in range(256)]}) for i in range(4)
    ]
    tiny = {"data_source": "gsm8k", "response": "#### 1", "ground_truth": "1"}
    hostile = [
        (
            "qa-262k-open-tags",
            orjson.dumps(
                {
                    "items": [
                        {
                            "data_source": "nq",
                            "response": "<answer>" * 32768,
                            "ground_truth": {"target": ["x"]},
                        }
                    ]
                }
            ),
            120.0,
        ),
        (
            "6-hanging-math",
            orjson.dumps(
                {
                    "items": [
                        {"data_source": "math", "response": HANG, "ground_truth": str(i)} for i in range(6)
                    ]
                }
            ),
            300.0,
        ),
        ("53MB-1e6-items", orjson.dumps({"items": [tiny] * 10**6}), 120.0),
        (
            "overflowing-options",
            orjson.dumps({"items": [tiny], "options": {"format_score": 1e308, "format_bonus": 1e308}}),
            60.0,
        ),
        (
            "hangs-up-after-1s",
            orjson.dumps({"items": [{"data_source": "math", "response": HANG, "ground_truth": "1"}] * 4}),
            1.0,
        ),
    ]
    return (lambda i: goods[i % len(goods)]), hostile


def retrieval_inputs() -> tuple[Callable[[int], bytes], list[tuple[str, bytes, float]]]:
    pool = questions(2000)
    long_queries = [f"{pool[i]} " + "filler " * 565 for i in range(1000)]
    hostile = [
        ("1000-queries-of-4000-chars", orjson.dumps({"queries": long_queries, "topk": 3}), 600.0),
        ("lone-surrogate", b'{"queries": ["\\ud800"], "topk": 3}', 60.0),
        ("5MB-body", b'{"queries": ["' + b"a" * (5 * 1024 * 1024) + b'"]}', 60.0),
    ]
    return (
        lambda i: orjson.dumps({"queries": [pool[i % len(pool)]], "topk": 3, "return_scores": True})
    ), hostile


async def run_phase(url: str, path: str, good_body, good_clients: int, seconds: float, hostile=None) -> dict:
    latencies: list[float] = []
    failures: collections.Counter = collections.Counter()
    hostile_statuses: collections.Counter = collections.Counter()
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=good_clients + 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        counter = iter(range(10**9))

        async def good() -> None:
            while time.perf_counter() < deadline:
                body = good_body(next(counter))
                sent = time.perf_counter()
                try:
                    response = await http.post(
                        url + path, content=body, headers={"content-type": "application/json"}
                    )
                    if response.status_code != 200:
                        failures[str(response.status_code)] += 1
                except httpx.HTTPError as exc:
                    failures[type(exc).__name__] += 1
                latencies.append(time.perf_counter() - sent)

        async def bad(own: httpx.AsyncClient, name: str, body: bytes, timeout: float) -> None:
            while time.perf_counter() < deadline:
                try:
                    response = await own.post(
                        url + path,
                        content=body,
                        headers={"content-type": "application/json"},
                        timeout=timeout,
                    )
                    hostile_statuses[f"{name}:{response.status_code}"] += 1
                except httpx.HTTPError as exc:
                    hostile_statuses[f"{name}:{type(exc).__name__}"] += 1

        async def hostile_client() -> None:
            # One client with its own connections (hanging up must not touch the good ones); each input
            # in its own loop, so a slow one (hanging math) does not keep the others from being sent.
            async with httpx.AsyncClient() as own:
                await asyncio.gather(*(bad(own, *case) for case in hostile))

        tasks = [asyncio.ensure_future(good()) for _ in range(good_clients)]
        bad_task = asyncio.ensure_future(hostile_client()) if hostile else None
        began = time.perf_counter()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - began
        if bad_task is not None:
            bad_task.cancel()  # a request still in flight is abandoned (the server drops its work)
            await asyncio.gather(bad_task, return_exceptions=True)
    latencies.sort()
    return {
        "good_clients": good_clients,
        "hostile": bool(hostile),
        "good_requests": len(latencies),
        "good_failures": dict(failures),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1e3 * statistics.median(latencies), 1),
        "p99_ms": round(1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1),
        "hostile_statuses": dict(hostile_statuses),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }


def start(module: str, args: list[str]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        module,
        *args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
    ]
    server = subprocess.Popen(command, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 300, server)
    return url, server


def bench_service(service: str, seconds: float, clients: int, work_dir: Path) -> list[dict]:
    if service == "reward":
        module, args, path, (good_body, hostile) = (
            "services.reward_server",
            [],
            "/v1/rewards",
            reward_inputs(),
        )
    else:
        index = ensure_index(work_dir)
        module, args, path = "services.retrieval_server", ["serve", "--index", str(index)], "/retrieve"
        good_body, hostile = retrieval_inputs()
    rows = []
    for with_hostile in (False, True):
        url, server = start(module, args)  # a fresh server per run: nothing left over from the last one
        try:
            asyncio.run(run_phase(url, path, good_body, clients - 1, 2.0))  # warm up
            row = asyncio.run(
                run_phase(url, path, good_body, clients - 1, seconds, hostile if with_hostile else None)
            )
        finally:
            stop_process(server)
        row["service"] = service
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", choices=["reward", "retrieval", "both"], default="both")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--clients", type=int, default=64, help="Concurrent clients, the hostile one included."
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/retrieval_bench"))
    args = parser.parse_args()
    services = ["reward", "retrieval"] if args.service == "both" else [args.service]
    rows = [
        row
        for service in services
        for row in bench_service(service, args.seconds, args.clients, args.work_dir)
    ]
    print(f"\n{os.cpu_count()} cores; load average now {os.getloadavg()}")
    print("| service | hostile client | good requests | good failures | req/s | p50 ms | p99 ms | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['service']} | {'yes' if r['hostile'] else 'no'} | {r['good_requests']} | "
            f"{sum(r['good_failures'].values())} | {r['requests_per_s']} | {r['p50_ms']} | {r['p99_ms']} | "
            f"{r['load_avg_1m']} |"
        )
    for service in services:
        base, hostile = [r for r in rows if r["service"] == service]
        ratio = hostile["p99_ms"] / base["p99_ms"]
        failed = sum(hostile["good_failures"].values()) + sum(base["good_failures"].values())
        verdict = "met" if ratio <= 2 and not failed else "NOT met"
        print(f"{service}: good p99 x{ratio:.2f} with the hostile client, {failed} good failures: {verdict}")
        print(f"  hostile statuses: {hostile['hostile_statuses']}")


if __name__ == "__main__":
    main()
