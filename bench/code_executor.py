"""code-executor throughput against a bare subprocess, and good runs' latency beside a hostile one.

    python bench/code_executor.py [--runs 300] [--workers N] [--repeats 2]

1. runs/s: `--runs` small Python programs through POST /v1/runs (batches of 50, two batches in flight;
   the service with `--workers` slots, default its own default) against the floor: the same programs,
   same interpreter, written to a file and run with a bare `subprocess.run` by as many threads as CPUs
   and by as many as the service's workers, the faster of the two (no sandbox, no HTTP). Aim: the
   service >= 0.5x the floor.
2. p50/p99 of good runs (one /run_code at a time) while another client keeps a hostile program (an
   infinite loop, run_timeout 2 s) running beside them.
Each side runs `--repeats` times; the median and the range are printed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from services.code_executor.app import CodeExecutorSettings  # noqa: E402
from services.common.settings import usable_cpus  # noqa: E402
from tests.helpers import service_process  # noqa: E402

PROGRAM = "total = sum(i * i for i in range({n}))\nprint(total)\n"
HOSTILE = "while True:\n    pass\n"


def programs(count: int) -> list[str]:
    return [PROGRAM.format(n=1000 + i) for i in range(count)]


def bare_runs_per_s(python: str, codes: list[str], workers: int) -> float:
    with tempfile.TemporaryDirectory() as scratch:

        def run(index_code):
            index, code = index_code
            path = Path(scratch) / f"p{index}.py"
            path.write_text(code)
            done = subprocess.run([python, str(path)], capture_output=True, timeout=30)
            assert done.returncode == 0

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, enumerate(codes)))
        return len(codes) / (time.perf_counter() - start)


def service_runs_per_s(url: str, codes: list[str], batch: int = 50) -> float:
    chunks = [codes[i : i + batch] for i in range(0, len(codes), batch)]

    def send(chunk):
        body = {"runs": [{"code": code} for code in chunk]}
        results = httpx.post(url + "/v1/runs", json=body, timeout=300).json()["results"]
        assert all(r["status"] == "Success" for r in results), results[:2]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(send, chunks))
    return len(codes) / (time.perf_counter() - start)


def latencies_beside_hostile(url: str, count: int) -> tuple[float, float]:
    stop = threading.Event()

    def hostile():
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                client.post(url + "/run_code", json={"code": HOSTILE, "run_timeout": 2})

    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    time.sleep(0.5)
    took = []
    with httpx.Client(timeout=60) as client:
        for code in programs(count):
            start = time.perf_counter()
            answer = client.post(url + "/run_code", json={"code": code}).json()
            took.append(time.perf_counter() - start)
            assert answer["status"] == "Success", answer
    stop.set()
    thread.join()
    took.sort()
    return took[len(took) // 2], took[min(len(took) - 1, int(len(took) * 0.99))]


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.1f} (range {min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--workers", type=int, default=None, help="the service's slots (default: its own)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--latency-runs", type=int, default=200)
    args = parser.parse_args()
    codes = programs(args.runs)
    workers = args.workers or CodeExecutorSettings().workers
    with service_process("services.code_executor", "--workers", str(workers), "--log-level", "warning") as (
        url,
        _,
    ):
        python = httpx.get(url + "/v1/languages").json()["languages"][0]["command"][0]
        bare, served, p50s, p99s = [], [], [], []
        for _ in range(args.repeats):
            threads = sorted({usable_cpus(), workers})
            bare.append(max(bare_runs_per_s(python, codes, count) for count in threads))
            served.append(service_runs_per_s(url, codes))
        for _ in range(args.repeats):
            p50, p99 = latencies_beside_hostile(url, args.latency_runs)
            p50s.append(p50 * 1e3)
            p99s.append(p99 * 1e3)
    ratios = [s / b for s, b in zip(served, bare)]
    print(
        f"interpreter: {python}; {args.runs} programs, {workers} workers on {usable_cpus()} CPUs, "
        f"{args.repeats} repeats; the floor: bare with {' or '.join(map(str, threads))} threads, the faster"
    )
    print(f"bare subprocess runs/s: {spread(bare)}")
    print(f"code-executor runs/s:   {spread(served)}")
    low, high = min(ratios), max(ratios)
    print(f"ratio (service / bare): median {statistics.median(ratios):.2f} (range {low:.2f}-{high:.2f})")
    print(f"good runs beside a hostile loop, p50 ms: {spread(p50s)}")
    print(f"good runs beside a hostile loop, p99 ms: {spread(p99s)}")


if __name__ == "__main__":
    main()
