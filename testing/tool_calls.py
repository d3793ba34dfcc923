"""Test support for runs with both tools: a tiny model taught to search, run code, then answer.

The job group's jobgroup/tools/search_code_tool_config.yaml names the tools `search` and
`code_interpreter`; with several tools the run uses the hermes format, so the model writes

    <tool_call>{"name": "search", "arguments": {"query_list": ["river"]}}</tool_call>
    ... the search result (a tool message) ...
    <tool_call>{"name": "code_interpreter", "arguments": {"code": "print(3 + 4)"}}</tool_call>
    ... what the program printed, 7 (a tool message) ...
    <answer> 7 </answer><|im_end|>          (or 9, taught as often: only 7 is right, so GRPO has a signal)

`teach_two_tools` fine-tunes the model on exactly the tokens the agent loop puts in front of it: the
tool messages are made by the loop's own HermesFormat and Truncation over the char tokenizer's chat
template, with the search result cut to SEARCH_RESULT_TOKENS on the left (its first tokens are the same
for every query: `{"result": "Doc `), and the program's output as the code-executor prints it.
"""

from __future__ import annotations

import json
from pathlib import Path

from testing.search import QA_ROWS, fine_tune

SEARCH_CALL = '<tool_call>{"name": "search", "arguments": {"query_list": ["river"]}}</tool_call>'
CODE_CALL = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(3 + 4)"}}</tool_call>'
CODE_OUTPUT = "7\n"
ANSWERS = ("<answer> 7 </answer>", "<answer> 9 </answer>")
# multi_turn.max_tool_response_length with tool_response_truncate_side=left: the search result keeps
# `{"result": "Doc ` and the cut's marker; the program's output (2 tokens) is whole.
SEARCH_RESULT_TOKENS = 16
SEARCH_RESULT = json.dumps({"result": 'Doc 1 (Title: "River")\nThe passage.'})  # its first 16 tokens count


def two_tool_row(index: int) -> dict:
    """A verl row (data_source nq, scored by exact match) with a short prompt; the answer is always 7."""
    question = QA_ROWS[index % len(QA_ROWS)]["question"]
    return {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": f"{question} Search, run code, answer 7 or 9."}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["7"]}},
        "extra_info": {"index": index},
    }


def teach_two_tools(
    model_dir: str | Path, rows: list[dict], *, steps: int = 80, lr: float = 1e-2, seed: int = 0
) -> float:
    """Fine-tune the tiny model in `model_dir` (in place) on whole trajectories of these rows, the loss
    on the three model turns alone: the search call after the prompt, the code call after the search
    result, the answer (closed by the end-of-turn token) after the program's output; the tool messages
    between them are context, as the loss mask makes them in training. Every row is taught with both
    answers, 7 and 9, so a group of rollouts on any of them answers both ways. Returns the last loss."""
    from trainer.agent.formats import HermesFormat, Truncation, encode_literal
    from trainer.model import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))  # the trainer's: it keeps the char tokenizer intact
    hermes = HermesFormat(tokenizer, tool_names=("search", "code_interpreter"))
    cut = Truncation.build(tokenizer, SEARCH_RESULT_TOKENS, "left")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def tool_message(text: str) -> list[int]:
        """The loop's tokens after a turn that stopped at `</tool_call>` (its last token is `>`)."""
        return hermes.observation([cut.apply(encode_literal(tokenizer, text))], ">")

    sequences = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for answer in ANSWERS:
            pieces = [  # (ids, 1 on the model's turns)
                (encode(prompt), 0),
                (encode(SEARCH_CALL), 1),
                (tool_message(SEARCH_RESULT), 0),
                (encode(CODE_CALL), 1),
                (tool_message(CODE_OUTPUT), 0),
                (encode(answer) + [tokenizer.eos_token_id], 1),
            ]
            ids = [token for piece, _ in pieces for token in piece]
            mask = [flag for piece, flag in pieces for _ in piece]
            sequences.append((ids, mask))
    return fine_tune(model_dir, sequences, pad_id=tokenizer.pad_token_id, steps=steps, lr=lr, seed=seed)
