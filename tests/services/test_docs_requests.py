"""docs/services.md, run as written: each service started by the page's own (offline) command, then each of
its `curl` requests sent to it, answering 200 with the fields the page says come back (`# -> {...}`).

The only edits: a free loopback port for the page's fixed one, a real folder or corpus for its DIR and
wiki-18.jsonl placeholders, and HOME in a temporary folder (the page writes under ~/). Commands marked
as needing the hub are the twins of offline ones that run here."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import ROOT, SHARED_DATA, code_sandbox_missing, service_process

PAGE = ROOT / "docs" / "services.md"
MODULES = {8000: "services.data_server", 8001: "services.reward_server", 8002: "services.retrieval_server",
           8003: "services.code_executor"}  # fmt: skip


def page_blocks() -> list[list[tuple[str, str]]]:
    """Each bash block of the page: (command, what follows it up to the next command), lines joined."""
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.DOTALL):
        entries: list[tuple[str, str]] = []
        pending = ""
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if not pending and line.lstrip().startswith("#"):
                if entries:
                    entries[-1] = (entries[-1][0], entries[-1][1] + line.strip().lstrip("#").strip() + "\n")
                continue
            pending += ("\n" if pending else "") + line
            if pending.partition("  #")[0].count("'") % 2:  # a quoted body goes on to the next line
                continue
            entries.append((pending.partition("  #")[0].strip(), ""))
            pending = ""
        blocks.append(entries)
    return blocks


def server_command(block: list[tuple[str, str]], port: int) -> list[str] | None:
    """The page's offline command that serves on `port` in this block, as arguments after the module."""
    for command, _ in block:
        words = shlex.split(re.sub(r"\[[^]]*\]", "", command))  # [--optional flags] shown as usage
        if words[:3] == ["python", "-m", MODULES[port]] and "--port" in words and "hub:" not in command:
            at = words.index("--port")
            if words[at + 1] == str(port):
                return words[3:at] + words[at + 2 :]
    return None


def expected_keys(note: str) -> set[str]:
    """The JSON keys a `# -> {...}` note shows."""
    shown = "".join(line.partition("->")[2] for line in note.splitlines() if line.startswith("->"))
    return set(re.findall(r'"(\w+)"\s*:', shown))


def keys_of(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in keys_of(v)}
    if isinstance(value, list):
        return {k for v in value for k in keys_of(v)}
    return set()


def curl(command: str, port: int, url: str) -> tuple[int, object]:
    shell = command.replace(f"localhost:{port}", url) + " -w '\\n%{http_code}'"
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"{command}: curl exited {done.returncode}: {done.stderr[-500:]}"
    body, _, status = done.stdout.rpartition("\n")
    return int(status), json.loads(body)


def placeholders(args: list[str], tmp_path) -> list[str]:
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():  # 200 passages of the HotpotQA slice: embedded in seconds
        lines = (SHARED_DATA / "wiki" / "hotpot_dev100_corpus.jsonl").read_text().splitlines()[:200]
        corpus.write_text("\n".join(lines) + "\n")
    swap = {r"\bDIR\b": str(SHARED_DATA / "gsm8k"), r"^wiki-18\.jsonl$": str(corpus), "^~": str(tmp_path)}
    for pattern, value in swap.items():
        args = [re.sub(pattern, value, arg) for arg in args]
    return args


def build_index(block: list[tuple[str, str]], tmp_path) -> None:
    """The block's offline `build` command (MiniLM, shipped with the package), run as written."""
    build = next(
        c for c, note in block if " build " in c and "--embedder" not in c and "--vectors-from" not in c
    )
    args = placeholders(shlex.split(build)[3:], tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", MODULES[8002], *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{build}: {done.stderr[-2000:]}"


CASES = [pytest.param(port, id=module.split(".")[1]) for port, module in MODULES.items()]


@pytest.mark.skipif(not (SHARED_DATA / "gsm8k" / "train.jsonl").is_file(), reason="needs ../shared/data")
@pytest.mark.parametrize("port", CASES)
def test_each_curl_on_the_page_gets_what_the_page_says(port, tmp_path):
    if port == 8003 and (why := code_sandbox_missing()):
        pytest.skip(f"the code-executor cannot start here: {why}")
    block = next(b for b in page_blocks() if any(f"localhost:{port}" in c for c, _ in b))
    args = server_command(block, port)
    assert args is not None, f"docs/services.md shows no offline command serving on :{port}"
    if port == 8002:
        build_index(block, tmp_path)
    requests = [(c, note) for c, note in block if c.startswith("curl ") and f"localhost:{port}" in c]
    assert requests, f"docs/services.md shows no request to :{port}"
    with service_process(MODULES[port], *placeholders(args, tmp_path), timeout_s=300) as (url, _):
        for command, note in requests:
            status, answer = curl(command, port, url.removeprefix("http://"))
            assert status == 200, f"{command}\n-> {status} {answer}"
            missing = expected_keys(note) - keys_of(answer)
            assert not missing, f"{command}\n-> {answer}\nthe page shows {sorted(missing)} too"
            if isinstance(answer, dict) and "results" in answer:  # the reward examples are right answers
                assert all(r["error"] is None and r["score"] == 1.0 for r in answer["results"]), answer
