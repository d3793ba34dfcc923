"""The README's first command: the service group on this machine, offline.

Starts the data-server on loopback, waits for /health, pulls two batches by cursor and prints them.
(Grows into the full offline GRPO demo as the trainer lands.)
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _pull(url: str) -> None:
    from services.data_server.client import DataClient

    async with DataClient(url) as client:
        await client.wait_healthy(120)
        print(json.dumps((await client.datasets()).model_dump(), indent=1))
        cursor = None
        for step in range(2):
            batch = await client.batch("synthetic-arith", "train", 4, cursor)
            print(f"batch {step}: epoch {batch.epoch} offset {batch.offset} -> next_cursor {batch.next_cursor}")
            for item in batch.items:
                print(f"  {item.uid}: {item.prompt[-1].content[:80]}... | answer {item.reward_model.ground_truth}")
            cursor = batch.next_cursor


def main() -> None:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "services.data_server", "--host", "127.0.0.1", "--port", str(port), "--log-format", "text"]
    )
    try:
        asyncio.run(_pull(f"http://127.0.0.1:{port}"))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    main()
