"""Session-wide settings of the tests, serial or in pytest-xdist workers (`-n 2`, the README's command).

Under xdist:
  - each worker, and every process it starts (services, launchers, trainers, Ray's workers), runs one
    OpenMP/MKL thread: torch otherwise runs as many as there are cores in each process, and two workers
    plus the trainers they start oversubscribe a 2-core machine several times over (BENCHMARKS.md,
    "What CI costs");
  - the tests go to the workers a module at a time (a module's fixtures, its servers and models, start
    once), the Docker pair (test_compose.py then test_multinode.py, on test_compose's images) first and on
    one worker, the costliest modules next, so that short ones fill the end;
  - each worker's code-executors run their sandboxes under uids of their own.
Serial or not, a trainer the tests start never joins a Ray cluster it finds on this machine (Ray's
address "auto" takes any raylet `ps` shows, a Docker test's container's included): RAY_ADDRESS=local.
"""

import os
import sys

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... in an xdist worker; unset otherwise

if WORKER:  # before torch loads: the test modules import it after this file
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_name, "1")
    # tests that pass --uid-base (61500, 61700) keep theirs; the default, 61000, moves per worker
    os.environ.setdefault("CODE_EXECUTOR_UID_BASE", str(62000 + 100 * int(WORKER.removeprefix("gw") or 0)))
os.environ.setdefault("RAY_ADDRESS", "local")

DOCKER_GROUP = "docker"
DOCKER_MODULES = ("tests/e2e/test_compose.py", "tests/e2e/test_multinode.py")
# Modules of more than ~60 s (their tests' --durations summed, under `-n 2`: BENCHMARKS.md "What CI costs"),
# costliest first: handed out right after the Docker pair. The rest follow in collection order. A stale
# entry only makes the end of a run less even.
SLOW_MODULES = (
    "tests/e2e/test_train_e2e.py",
    "tests/trainer/test_distributed.py",
    "tests/e2e/test_user_commands.py",
    "tests/e2e/test_bench_learning.py",
    "tests/trainer/test_rollout_loop.py",
    "tests/services/test_retrieval_server.py",
    "tests/trainer/test_rollout_server.py",
    "tests/e2e/test_search_e2e.py",
    "tests/trainer/test_sglang_contract.py",
    "tests/e2e/test_local_launcher.py",
    "tests/services/test_fuzz_openapi.py",
    "tests/e2e/test_two_tools_e2e.py",
    "tests/services/test_code_executor.py",
    "tests/services/test_docs_requests.py",
)


def pytest_configure(config):
    if WORKER and "torch" in sys.modules:  # loaded before this file set the variables: set it directly
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (xdist's --dist load): a module per work unit, the Docker pair one unit, costliest first.
    Another --dist keeps xdist's own scheduler."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    order = {scope: rank for rank, scope in enumerate((DOCKER_GROUP, *SLOW_MODULES))}

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return DOCKER_GROUP if module in DOCKER_MODULES else module

        def _assign_work_unit(self, node) -> None:
            first = min(self.workqueue, key=lambda scope: order.get(scope, len(order)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
