"""Throughput and latency of the retrieval-server under many one-query clients in another process.

Starts `python -m services.retrieval_server serve` as its own process on a loopback port, over a flat
MiniLM index of the SQuAD dev corpus (../shared/data/wiki; built once into --work-dir) with the
service's default embedder and settings (the access log off). This process then drives it as a
trainer's agents would: at each level, N concurrent clients, each sending one SQuAD question per
POST /retrieve (top 3), back to back, each over a keep-alive connection of its own. --client says
how the clients hold their connections (all of them open N connections, one per client):

- own:     an httpx.AsyncClient per client (one connection each);
- threads: a thread per client, each with its own httpx.Client (sync);
- shared:  one httpx.AsyncClient for all, its pool holding N keep-alive connections;
- service: one of the project's RetrievalClient for all (max_connections=N), as a user would;
- sync-service: a thread per client, all sharing one SyncServiceClient (the reward hook's for verl, whose
           reward managers may call it from a thread pool).

Every client first sends one untimed request (its connection opens), then all start together and
send --requests-per-client timed requests each (20: 1,280 requests at 64 clients, at least 200 a
level). --runs repeats the sweep on the same server.

Per level, over the timed window: requests/s, client-side p50/p99, and from the server's /metrics the
mean micro-batch (queries per embed call) and mean compute per batch (embed + search + JSON, on the batch
worker); the CPU the server used per request, and the cores the server and this client process used:
both share the machine's cores, so what the clients take the server does not get. The median and range
over the runs go in a table.

The aim: throughput at 64 clients >= 90% of that at 32, and p99 at 64 <= 2.5x p99 at 32, on the
medians of the runs.

    python bench/retrieval_server.py [--levels 1,8,32,64] [--requests-per-client 20] [--runs 2]
        [--client own|threads|shared|service|sync-service] [--index DIR] [--server-arg=--max-wait-ms=5 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import contextlib
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# ../shared/data/wiki from the checkout (a git worktree may sit one level deeper)
WIKI = next(
    (p / "shared" / "data" / "wiki" for p in ROOT.parents if (p / "shared" / "data" / "wiki").exists()),
    ROOT.parent / "shared" / "data" / "wiki",
)

from services.common.client import SyncServiceClient
from services.retrieval_server.client import RetrievalClient
from tests.helpers import service_process

MIN_REQUESTS = 200  # per level, so the p99 of a small level is not its single slowest request


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


class Gate:
    """Opens once every client has sent its warm-up request, so all start together on open connections;
    `on_open` runs just before (it snapshots the counters the level is measured by)."""

    def __init__(self, clients: int, on_open) -> None:
        self.waiting = clients
        self.on_open = on_open
        self.opened = asyncio.Event()

    async def pass_(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.on_open()
            self.opened.set()
        await self.opened.wait()


def payload(query: str) -> dict:
    return {"queries": [query], "topk": 3, "return_scores": True}


def checked(response: httpx.Response) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")


async def agent(retrieve, pool: list[str], first: int, timed: int, gate: Gate) -> list[float]:
    """One client: one warm-up request, then `timed` requests, one query each; their latencies."""
    latencies = []
    for i in range(timed + 1):
        if i == 1:
            await gate.pass_()
        sent = time.perf_counter()
        await retrieve(pool[(first + i) % len(pool)])
        latencies.append(time.perf_counter() - sent)
    return latencies[1:]


async def senders(stack: contextlib.AsyncExitStack, kind: str, url: str, clients: int) -> list:
    """One `retrieve(query)` per client, holding its connection as `kind` says."""

    def over(http: httpx.AsyncClient):
        async def retrieve(query: str) -> None:
            checked(await http.post("/retrieve", json=payload(query)))

        return retrieve

    if kind == "own":
        # one TLS context for all: an httpx client builds its own otherwise (~45 ms of CPU each)
        verify = httpx.create_ssl_context()
        one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        opened = []
        for _ in range(clients):
            http = httpx.AsyncClient(base_url=url, timeout=120, limits=one, verify=verify)
            opened.append(await stack.enter_async_context(http))
        return [over(http) for http in opened]
    if kind == "shared":
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120, limits=limits))
        return [over(http)] * clients
    service = await stack.enter_async_context(
        RetrievalClient(url, timeout_s=120, retries=0, max_connections=clients)
    )

    async def retrieve(query: str) -> None:
        await service.retrieve([query], topk=3)

    return [retrieve] * clients


async def load_level(
    url: str, kind: str, clients: int, per_client: int, pool: list[str], snapshot
) -> list[float]:
    """Latencies of every timed request; `snapshot()` runs once when the clock starts."""
    gate = Gate(clients, snapshot)
    async with contextlib.AsyncExitStack() as stack:
        retrieves = await senders(stack, kind, url, clients)
        runs = [agent(r, pool, c * (per_client + 1), per_client, gate) for c, r in enumerate(retrieves)]
        return [x for r in await asyncio.gather(*runs) for x in r]


def load_level_threads(
    url: str, kind: str, clients: int, per_client: int, pool: list[str], snapshot
) -> list[float]:
    """As load_level, each client a thread: with its own httpx.Client (`threads`), or all sharing one
    SyncServiceClient (`sync-service`)."""
    gate = threading.Barrier(clients, action=snapshot)
    latencies: list[float] = []
    shared = SyncServiceClient(url, timeout_s=120, retries=0) if kind == "sync-service" else None

    def run(first: int) -> None:
        if shared is None:
            one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            http = httpx.Client(base_url=url, timeout=120, limits=one)
            post, holder = (lambda body: checked(http.post("/retrieve", json=body))), http
        else:
            post, holder = (lambda body: shared.post("/retrieve", body)), contextlib.nullcontext()
        try:
            with holder:
                for i in range(per_client + 1):
                    if i == 1:
                        gate.wait()
                    sent = time.perf_counter()
                    post(payload(pool[(first + i) % len(pool)]))
                    if i:
                        latencies.append(time.perf_counter() - sent)  # list.append is atomic
        except threading.BrokenBarrierError:
            return  # another client failed first: its error is the one printed
        except Exception:
            gate.abort()  # the others waiting at the gate would wait for this one for ever
            raise

    threads = [threading.Thread(target=run, args=(c * (per_client + 1),)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if shared is not None:
        shared.close()
    if len(latencies) != clients * per_client:
        raise RuntimeError("a client thread failed (its error is printed above)")
    return latencies


METRICS = {
    "batches": r"^retrieval_server_batch_queries_count (\S+)$",
    "batch_queries": r"^retrieval_server_batch_queries_sum (\S+)$",
    "compute_s": r"^retrieval_server_batch_compute_seconds_sum (\S+)$",
    "requests": r'^retrieval_server_request_duration_seconds_count\{method="POST",route="/retrieve"\} (\S+)$',
    "request_s": r'^retrieval_server_request_duration_seconds_sum\{method="POST",route="/retrieve"\} (\S+)$',
}


def server_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    found = {}
    for name, pattern in METRICS.items():
        match = re.search(pattern, text, re.MULTILINE)
        found[name] = float(match.group(1)) if match else 0.0
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def counters(url: str, pid: int) -> dict[str, float]:
    """What a level is measured by: the server's /metrics, both processes' CPU seconds, the clock."""
    return {
        **server_metrics(url),
        "server_cpu": cpu_seconds(pid),
        "client_cpu": cpu_seconds(os.getpid()),
        "time": time.perf_counter(),
    }


def run_level(url: str, pid: int, kind: str, clients: int, per_client: int, pool: list[str]) -> dict:
    per_client = max(per_client, -(-MIN_REQUESTS // clients))
    at_start = {}

    def snapshot() -> None:
        at_start.update(counters(url, pid))

    # the snapshot blocks the clients for a moment; every client is waiting at the gate then
    if kind in ("threads", "sync-service"):
        latencies = load_level_threads(url, kind, clients, per_client, pool, snapshot)
    else:
        latencies = asyncio.run(load_level(url, kind, clients, per_client, pool, snapshot))
    at_end = counters(url, pid)
    delta = {k: at_end[k] - at_start[k] for k in at_end}
    elapsed = delta["time"]
    latencies.sort()
    return {
        "clients": clients,
        "requests": len(latencies),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1e3 * statistics.median(latencies), 1),
        "p99_ms": round(1e3 * percentile(latencies, 0.99), 1),
        "mean_batch": round(delta["batch_queries"] / max(1.0, delta["batches"]), 1),
        "batch_compute_ms": round(1e3 * delta["compute_s"] / max(1.0, delta["batches"]), 1),
        "server_request_ms": round(1e3 * delta["request_s"] / max(1.0, delta["requests"]), 1),
        "server_cores": round(delta["server_cpu"] / elapsed, 2),
        "client_cores": round(delta["client_cpu"] / elapsed, 2),
        "server_cpu_ms_per_request": round(1e3 * delta["server_cpu"] / len(latencies), 2),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }


COLUMNS = {
    "requests_per_s": "requests/s",
    "p50_ms": "p50 ms",
    "p99_ms": "p99 ms",
    "mean_batch": "mean micro-batch",
    "batch_compute_ms": "compute ms / batch",
    "server_cpu_ms_per_request": "server CPU ms / request",
    "server_cores": "server cores",
    "client_cores": "client cores",
}


def summary(rows: list[dict], levels: list[int]) -> list[dict]:
    """Per level: the median of each figure over the runs, with its range."""
    out = []
    for clients in levels:
        mine = [r for r in rows if r["clients"] == clients]
        entry = {"clients": clients, "runs": len(mine)}
        for key in COLUMNS:
            values = [r[key] for r in mine]
            entry[key] = (round(statistics.median(values), 2), min(values), max(values))
        out.append(entry)
    return out


def aims_verdict(table: list[dict]) -> str:
    by_clients = {e["clients"]: e for e in table}
    if 32 not in by_clients or 64 not in by_clients:
        return "aims not measured (need the 32- and 64-client levels)"
    rate32, rate64 = by_clients[32]["requests_per_s"][0], by_clients[64]["requests_per_s"][0]
    p99_32, p99_64 = by_clients[32]["p99_ms"][0], by_clients[64]["p99_ms"][0]
    checks = [
        (f"throughput 64 / 32 clients = {rate64 / rate32:.2f} >= 0.90", rate64 >= 0.9 * rate32),
        (f"p99 64 / 32 clients = {p99_64 / p99_32:.2f} <= 2.5", p99_64 <= 2.5 * p99_32),
    ]
    return "\n".join(f"{'met' if ok else 'NOT met'}: {text}" for text, ok in checks)


def print_table(table: list[dict]) -> None:
    print("| clients | runs | " + " | ".join(COLUMNS.values()) + " |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for e in table:
        cells = [f"{m:g} ({lo:g}–{hi:g})" for m, lo, hi in (e[k] for k in COLUMNS)]
        print(f"| {e['clients']} | {e['runs']} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,8,32,64", help="Client counts, comma-separated.")
    parser.add_argument("--requests-per-client", type=int, default=20, help="Timed requests per client.")
    parser.add_argument("--runs", type=int, default=2, help="Sweeps over the levels, same server.")
    parser.add_argument(
        "--client",
        choices=("own", "threads", "shared", "service", "sync-service"),
        default="own",
        help="How the clients hold their connections (see the module docstring).",
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/retrieval_bench"))
    parser.add_argument("--index", type=Path, default=None, help="Serve this index folder instead.")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="Extra serve flag, e.g. --server-arg=--threads=2."
    )
    args = parser.parse_args()
    if args.index is None and not (WIKI / "squad_dev_corpus.jsonl").exists():
        sys.exit(f"error: {WIKI} is not here; pass --index DIR")
    levels = [int(x) for x in args.levels.split(",")]
    index = args.index or ensure_index(args.work_dir)
    pool = questions(4000)
    # The access log (one line a request) off: the bench measures serving, not log shipping.
    serve = ["serve", "--index", str(index), "--log-level", "warning", *args.server_arg]
    rows = []
    with service_process("services.retrieval_server", *serve, timeout_s=300) as (url, server):
        health = httpx.get(url + "/health").json()
        print(json.dumps({"health": health, "client": args.client, "server_args": args.server_arg}))
        for run in range(args.runs):
            for clients in levels:
                level = run_level(url, server.pid, args.client, clients, args.requests_per_client, pool)
                row = {"run": run + 1, **level}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(
        f"\n{os.cpu_count()} cores; load average {os.getloadavg()}; client {args.client}; "
        f"median (min–max) of {args.runs} runs"
    )
    table = summary(rows, levels)
    print_table(table)
    print(aims_verdict(table))


if __name__ == "__main__":
    main()
