"""The multi-turn agent loop: rollouts that call the retrieval-server's search while they generate.

    formats.py  how a model asks for a search and how the result is written back, as token ids
                (Search-R1 tags, or hermes tool calls rendered by the chat template)
    tools.py    the search tool's settings: verl's multi_turn.tool_config_path YAML or services.*
    search.py   SearchBatcher: the queries of every trajectory waiting at a moment, in one /retrieve
    loop.py     AgentLoop: one coroutine per trajectory over the rollout manager's async generate
    build.py    the loop a run uses, from the config (trainer/build.py calls it when multi_turn.enable)

Nothing is imported here, so the config checks can read tools.py without loading torch.
"""
