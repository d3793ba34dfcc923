"""reward-server throughput: gsm8k items/s over HTTP vs in-process, and math-verify items/s through the pool.

    python bench/reward_server.py [--gsm8k ../shared/data/gsm8k] [--seconds 5] [--math-workers 2]

Starts a real server process (one uvicorn worker) on a free loopback port. Rows:
- gsm8k, in-process, scorer function: `score_gsm8k` called in a loop (the floor: regex work only).
- gsm8k, in-process, LocalScorer: `LocalScorer.score(list[RewardItem])`, what reward_model.mode=local runs.
- gsm8k, HTTP raw: batches of 1024 as pre-encoded JSON bodies, 1 and 4 requests in flight, each
  answer parsed; measures the server (the client costs little but shares the same cores).
- gsm8k, HTTP RewardClient: `RewardClient.score(list[RewardItem])` end to end (encode, send, build results).
- math, LocalScorer / HTTP: MATH-style \\boxed{} answers through the killable math-verify pool.
GSM8K responses are the dataset's own worked answers (ending "#### N"), half scored against a wrong truth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.data_server.synthetic import make_problem
from services.reward_server.client import RewardClient
from services.scoring import LocalScorer
from services.reward_server.schemas import RewardItem
from services.scoring.gsm8k import score_gsm8k
from tests.helpers import SHARED_DATA, service_process

BATCH = 1024


def gsm8k_items(folder: Path, n: int) -> list[dict]:
    """Real GSM8K worked answers when the folder exists, else synthetic-arith ones (same format)."""
    path = folder / "test.jsonl"
    if path.exists():
        answers = [json.loads(line)["answer"] for line in path.read_text().splitlines()]
    else:
        answers = [make_problem(0, "test", i, "medium").answer for i in range(n)]
    rng = random.Random(0)
    items = []
    for i in range(n):
        answer = answers[i % len(answers)]
        truth = answer.rsplit("#### ", 1)[1].replace(",", "").strip()
        items.append(
            {
                "data_source": "openai/gsm8k",
                "response": answer,
                "ground_truth": truth if i % 2 == 0 else str(rng.randint(1, 10**6)),
            }
        )
    return items


def math_items(n: int) -> list[dict]:
    shapes = [("\\frac{{{a}}}{{{b}}}", "{q}"), ("{a}\\sqrt{{2}}", "\\sqrt{{{s}}}"), ("x^2+{a}x", "x(x+{a})")]
    items = []
    for i in range(n):
        a, b = i % 7 + 1, i % 5 + 2
        answer, truth = shapes[i % 3]
        items.append(
            {
                "data_source": "lighteval/MATH",
                "response": "We simplify step by step. The answer is $\\boxed{"
                + answer.format(a=a, b=b)
                + "}$.",
                "ground_truth": truth.format(q=round(a / b, 6), s=2 * a * a, a=a),
            }
        )
    return items


def rate(count: int, seconds: float) -> float:
    return count / seconds


def time_function(items: list[dict], seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for item in items:
            score_gsm8k(item["response"], item["ground_truth"])
        done += len(items)
    return rate(done, time.perf_counter() - start)


async def time_local(scorer: LocalScorer, items: list[RewardItem], seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        await scorer.score(items)
        done += len(items)
    return rate(done, time.perf_counter() - start)


async def time_http_raw(url: str, items: list[dict], in_flight: int, seconds: float) -> float:
    body = orjson.dumps({"items": items})
    done, deadline = 0, time.perf_counter() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            response = await http.post(
                url + "/v1/rewards", content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == 200 and len(orjson.loads(response.content)["results"]) == len(
                items
            )
            done += len(items)

    async with httpx.AsyncClient(timeout=120) as http:
        await http.post(url + "/v1/rewards", content=body)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(in_flight)))
        return rate(done, time.perf_counter() - start)


async def time_client(url: str, items: list[RewardItem], seconds: float) -> float:
    async with RewardClient(url) as client:
        await client.score(items)  # warm-up, and reads the server's limits
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            await client.score(items)
            done += len(items)
        return rate(done, time.perf_counter() - start)


async def run_in_process(
    gsm8k: list[dict], maths: list[dict], seconds: float, workers: int
) -> dict[str, float]:
    models = [RewardItem(**item) for item in gsm8k]
    async with LocalScorer(math_workers=workers) as scorer:
        return {
            "gsm8k local": await time_local(scorer, models, seconds),
            "math local": await time_local(scorer, [RewardItem(**item) for item in maths], seconds),
        }


async def run_http(url: str, gsm8k: list[dict], maths: list[dict], seconds: float) -> dict[str, float]:
    return {
        "gsm8k http 1": await time_http_raw(url, gsm8k, 1, seconds),
        "gsm8k http 4": await time_http_raw(url, gsm8k, 4, seconds),
        "gsm8k client": await time_client(url, [RewardItem(**item) for item in gsm8k], seconds),
        "math http": await time_http_raw(url, maths, 2, seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gsm8k", type=Path, default=SHARED_DATA / "gsm8k")
    parser.add_argument("--seconds", type=float, default=5.0, help="Duration of each measurement.")
    parser.add_argument("--math-workers", type=int, default=2)
    args = parser.parse_args()
    gsm8k, maths = gsm8k_items(args.gsm8k, BATCH), math_items(256)
    function = time_function(gsm8k, args.seconds)
    local = asyncio.run(run_in_process(gsm8k, maths, args.seconds, args.math_workers))
    server_args = ["--math-workers", str(args.math_workers), "--log-level", "warning"]
    with service_process("services.reward_server", *server_args) as (url, _):
        http = asyncio.run(run_http(url, gsm8k, maths, args.seconds))
    mean_chars = sum(len(i["response"]) for i in gsm8k) / len(gsm8k)
    print(
        f"gsm8k batch={BATCH} (mean response {mean_chars:.0f} chars), math batch={len(maths)}, "
        f"math_workers={args.math_workers}, {args.seconds:g} s per row"
    )
    rows = [
        ("gsm8k", "in-process", "score_gsm8k() loop", function),
        ("gsm8k", "in-process", "LocalScorer.score", local["gsm8k local"]),
        ("gsm8k", "HTTP", "raw JSON, 1 in flight", http["gsm8k http 1"]),
        ("gsm8k", "HTTP", "raw JSON, 4 in flight", http["gsm8k http 4"]),
        ("gsm8k", "HTTP", "RewardClient.score", http["gsm8k client"]),
        ("math", "in-process", "LocalScorer.score (pool)", local["math local"]),
        ("math", "HTTP", "raw JSON, 2 in flight (pool)", http["math http"]),
    ]
    print(f"{'scorer':<7} {'path':<11} {'how':<30} {'items/s':>10}")
    for scorer, path, how, value in rows:
        print(f"{scorer:<7} {path:<11} {how:<30} {value:>10,.0f}")
    best_http = max(http["gsm8k http 1"], http["gsm8k http 4"])
    print(
        f"HTTP (best raw) / LocalScorer: {best_http / local['gsm8k local']:.2f}x;  "
        f"HTTP / scorer function: {best_http / function:.2f}x"
    )


if __name__ == "__main__":
    main()
