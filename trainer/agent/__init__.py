"""The multi-turn agent loop: rollouts that call tools (search, code interpreter) while they generate.

    tools.py    the tools' settings: verl's multi_turn.tool_config_path YAML (a list of tools), or
                services.* for the search tool alone
    formats.py  how a model calls a tool and how the responses are written back, as token ids
                (Search-R1 tags, or hermes tool calls rendered by the chat template)
    search.py   SearchTool (verl's SearchTool) over SearchBatcher: the queries of every trajectory
                waiting at a moment, in one /retrieve
    code.py     CodeTool (verl's SandboxFusionTool): a program per call on the code-executor's /run_code
    loop.py     AgentLoop: one coroutine per trajectory over the rollout manager's async generate; the
                tool-failure policy (text, retry, drop_group)
    build.py    the loop a run uses, from the config (trainer/build.py calls it when multi_turn.enable)

Nothing is imported here, so the config checks can read tools.py without loading torch.
"""
