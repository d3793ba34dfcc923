"""verl's own code against ours: verl 0.7.1's tool loader reads the job group's shipped tool configs
(jobgroup/tools/), and its SearchTool and SandboxFusionTool call our retrieval-server and code-executor
as a verl run would. .ci/run installs verl (no dependencies) into .verl; without it the test skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, service_process
from tests.trainer.test_agent_loop import bwrap_missing, index  # noqa: F401 (a fixture)

VERL = ROOT / ".verl"
INSTALL = 'pip install --no-deps --target .verl "verl==0.7.1" "tensordict==0.15.3" "pyvers==0.2.3"'


@pytest.mark.skipif(not (VERL / "verl").is_dir(), reason=f"verl is not installed: {INSTALL}")
@pytest.mark.skipif(bwrap_missing() is not None, reason="the code-executor needs bubblewrap (bwrap)")
def test_verl_runs_the_shipped_tool_config_against_our_services(index):  # noqa: F811
    with (
        service_process("services.retrieval_server", "serve", "--index", str(index)) as (retrieval, _),
        service_process("services.code_executor") as (code, _),
    ):
        env = {
            **os.environ,
            "PYTHONPATH": str(VERL),
            "RETRIEVAL_SERVER_URL": retrieval,
            "CODE_EXECUTOR_URL": code,
        }
        config = ROOT / "jobgroup" / "tools" / "search_code_tool_config.yaml"
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "e2e" / "verl_tool_probe.py"), str(config)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("ANSWERS "))
    answers = json.loads(line.removeprefix("ANSWERS "))
    # verl's SearchTool wraps the retrieval-server's passages in its own {"result": ...} text
    passages = json.loads(answers["search"])["result"]
    assert "Callow was a composer of harp music, born in the year 1617" in passages
    assert answers["code_interpreter"].strip() == "1634"  # SandboxFusionTool prints the run's stdout
