"""Run by tests/e2e/test_verl_interop.py with verl on the path: verl's tool loader reads a tool config, then
each tool does one call as verl's agent loop makes it (create, execute); the answers print as one JSON line.

    python tests/e2e/verl_tool_probe.py CONFIG.yaml   # RETRIEVAL_SERVER_URL, CODE_EXECUTOR_URL set
"""

import asyncio
import json
import sys

import ray
from verl.tools.utils.tool_registry import initialize_tools_from_config

CALLS = {  # tool name -> the arguments a model would send
    "search": {"query_list": ["Callow composer"]},
    "code_interpreter": {"code": "print(1617 + 17)"},
}


async def main(config: str) -> None:
    answers = {}
    for tool in initialize_tools_from_config(config):
        instance, _ = await tool.create()
        response, _, _ = await tool.execute(instance, CALLS[tool.name])
        await tool.release(instance)
        answers[tool.name] = response.text
    print("ANSWERS " + json.dumps(answers))


if __name__ == "__main__":
    # a Ray of its own (verl's tools rate-limit through an actor), not a cluster RAY_ADDRESS names
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    asyncio.run(main(sys.argv[1]))
