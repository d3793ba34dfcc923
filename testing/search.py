"""Test support for the search agent loop: a made-up corpus with questions, and a scripted policy.

- `CORPUS` / `QA_ROWS`: 36 passages about invented rivers, composers and volcanoes, and a question
  only its own passage answers, so BM25 over the corpus finds the right passage by name and the
  answers are known. `write_corpus(path)` writes the retrieval-server's corpus .jsonl.
- `ScriptedReplica`: a rollout replica (the ReplicaPool's interface) whose "model" is a Python
  function from the context so far to the next turn's text. It tokenizes that text and honours
  max_new_tokens, stop strings and the end-of-turn token as an engine does, so the agent loop runs
  over the real pool and manager with fixed outputs, and every request it got is kept for checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from trainer.rollout.protocol import finish_reason, output_item, rollouts_from_outputs

RIVERS = ["Norvik", "Esterhal", "Quillon", "Maradu", "Tesskel", "Orbanne", "Vellmar", "Kapsis", "Limbreth"]
SEAS = ["Amber", "Coral", "Silver", "Crimson", "Jade", "Azure", "Obsidian", "Ivory", "Saffron"]
TOWNS = ["Dunmere", "Callow", "Pessary", "Ruthven", "Ollin", "Skarn", "Tibbet", "Wyvold", "Yarrow"]
PEAKS = ["Korrath", "Ulvenne", "Darsk", "Mirrow", "Feyhold", "Gannet", "Hollin", "Istra", "Jorund"]


def _passages() -> tuple[list[dict], list[dict]]:
    corpus, qa = [], []
    for i, (river, sea, town, peak) in enumerate(zip(RIVERS, SEAS, TOWNS, PEAKS)):
        year, height = 1600 + 17 * i, 900 + 131 * i
        facts = [
            (f"{river} River",
             f"The {river} River flows through the {town} valley and ends in the {sea} Sea.",
             f"Which sea does the {river} River end in?", sea),
            (f"{town} (composer)",
             f"{town} was a composer of harp music, born in the year {year}.",
             f"In which year was the composer {town} born?", str(year)),
            (f"Mount {peak}",
             f"Mount {peak} is a volcano {height} metres high, first climbed by {river} scouts.",
             f"How many metres high is Mount {peak}?", str(height)),
            (f"{sea} Sea",
             f"The {sea} Sea is a shallow sea where {peak} whales gather every winter.",
             f"Which whales gather in the {sea} Sea?", peak),
        ]  # fmt: skip
        for j, (title, text, question, answer) in enumerate(facts):
            pid = f"d{i * 4 + j}"
            corpus.append({"id": pid, "contents": f'"{title}"\n{text}'})
            qa.append({"id": f"q{i * 4 + j}", "question": question, "golden_answers": [answer], "gold": pid})
    return corpus, qa


CORPUS, QA_ROWS = _passages()


def write_corpus(path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    return path


def write_search_rows(folder: str | Path, train: range, test: range) -> Path:
    """train.jsonl and test.jsonl of short_search_row rows (these indices) in `folder`: a data-server
    dataset (`--datasets NAME=folder`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for split, indices in (("train", train), ("test", test)):
        (folder / f"{split}.jsonl").write_text(
            "".join(json.dumps(short_search_row(i)) + "\n" for i in indices)
        )
    return folder


def write_qa(path: str | Path, rows: list[dict] | None = None) -> Path:
    """Rows in the data-server's QA shape ({question, golden_answers}): it adds the Search-R1 instruction."""
    path = Path(path)
    rows = QA_ROWS if rows is None else rows
    path.write_text(
        "".join(json.dumps({k: r[k] for k in ("question", "golden_answers")}) + "\n" for r in rows)
    )
    return path


Policy = Callable[[str], str]  # decoded context (prompt + response so far) -> the next turn's text


class ScriptedReplica:
    """A replica whose turns come from `policy`; `requests` keeps every (input_ids, sampling_params)."""

    def __init__(self, tokenizer, policy: Policy, *, logprob: float = -0.5, name: str = "scripted") -> None:
        self.tokenizer = tokenizer
        self.policy = policy
        self.logprob = logprob
        self.name = name
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.requests: list[tuple[list[int], dict]] = []
        self.outputs: list[list[int]] = []  # every turn's output ids, in the order they were made

    async def generate(self, payload: dict) -> list[dict]:
        ids, params = list(payload["input_ids"]), dict(payload["sampling_params"])
        self.requests.append((ids, params))
        text = self.policy(self.tokenizer.decode(ids, skip_special_tokens=False))
        tokens, kind, matched = self.turn_tokens(text, params)
        self.outputs.append(tokens)
        item = output_item(
            rid=f"scripted-{len(self.requests)}",
            text="",
            output_ids=tokens,
            logprobs=[self.logprob] * len(tokens),
            finish=finish_reason(kind, matched),
            prompt_tokens=len(ids),
            weight_version="default",
            e2e_latency=0.0,
        )
        return [item] * params.get("n", 1)

    async def rollouts(self, payload: dict, prompt_index: int):
        return rollouts_from_outputs(payload["input_ids"], prompt_index, await self.generate(payload))

    def turn_tokens(self, text: str, params: dict) -> tuple[list[int], str, int | str]:
        """The text's tokens cut as an engine cuts: after the token that completes a stop string, at
        max_new_tokens, or whole and followed by the end-of-turn token."""
        tokens = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.eos_id]
        stops, limit = params.get("stop") or [], params["max_new_tokens"]
        for end in range(1, len(tokens) + 1):
            if tokens[end - 1] == self.eos_id:
                return tokens[:end], "stop", self.eos_id
            if stops:
                piece = self.tokenizer.decode(tokens[:end], skip_special_tokens=False)
                hit = next((s for s in stops if s in piece), None)
                if hit is not None:
                    return tokens[:end], "stop", hit
            if end == limit:
                return tokens[:end], "length", limit
        raise AssertionError("unreachable: the end-of-turn token ends every script")

    async def update_weights_from_disk(self, model_path: str, **kwargs) -> None:
        pass

    async def update_weights_from_tensor(self, named_tensors, **kwargs) -> None:
        pass

    async def release_memory_occupation(self, tags=None) -> None:
        pass

    async def resume_memory_occupation(self, tags=None) -> None:
        pass

    async def flush_cache(self) -> None:
        pass

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------ warm start

SEARCH_TURN = "<search> river </search>"
ANSWERS = ("<answer> 7 </answer>", "<answer> 9 </answer>")  # digits: no letter of "answer" to confuse
# What the loop appends after a search with the char tokenizer, multi_turn.format=search_r1,
# max_tool_response_length=SEARCH_RESULT_TOKENS and tool_response_truncate_side=left: the same for every
# query, so the tiny model meets in training exactly the tokens it meets in the rollouts.
SEARCH_RESULT_TOKENS = 13
# The same cut for the Qwen tokenizer: `Doc 1(Title: "` is its first 7 tokens of every passage here.
QWEN_SEARCH_RESULT_TOKENS = 7


def short_search_row(index: int) -> dict:
    """A verl row (data_source nq) with a short prompt: a CPU-sized stand-in for Search-R1's, whose
    instruction alone is ~500 characters. The answer is always 7."""
    question = QA_ROWS[index % len(QA_ROWS)]["question"]
    return {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": f"{question} Search, then answer 7 or 9."}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["7"]}},
        "extra_info": {"index": index},
    }


def taught_run_keys(
    model: str | Path, dataset: str, out: Path, *, response_length: int, tool_tokens: int
) -> list[str]:
    """The trainer keys of a short GRPO run of a taught tiny model on CPU (the tool tests' runs): 4 prompts
    x 4 samples, 2 steps, up to 3 assistant turns, each tool response cut on the left to `tool_tokens`
    as the model was taught it; metrics, checkpoints and the rollouts' dump under `out`."""
    return [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={model}",
        f"data.dataset={dataset}",
        "data.train_batch_size=4",
        "data.max_prompt_length=128",
        f"data.max_response_length={response_length}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-4",  # 1e-3 undid the teaching in one step on some CPUs
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={tool_tokens}",
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.device=cpu",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.log_dir={out / 'run'}",
        f"trainer.rollout_data_dir={out / 'rollouts'}",
    ]


def search_information(tokenizer, tool_tokens: int) -> list[int]:
    """The ids the agent loop appends after a search (format search_r1, max_tool_response_length=
    tool_tokens, truncate side left): `\\n\\n<information>`, the result's first tool_tokens tokens, the
    cut's marker, `</information>\\n\\n`. Raises ValueError when those tokens differ between the passages
    of CORPUS (the model would then meet a context it was not taught)."""
    from trainer.agent.formats import SearchR1Format, Truncation, encode_literal

    starts = set()
    for passage in CORPUS:  # each as the first line of a result (services/retrieval_server/client.py)
        title, _, text = passage["contents"].partition("\n")
        starts.add(tuple(encode_literal(tokenizer, f"Doc 1(Title: {title}) {text}")[:tool_tokens]))
    if len(starts) != 1:
        raise ValueError(f"the first {tool_tokens} tokens of a search result differ between passages")
    cut = Truncation.build(tokenizer, tool_tokens, "left")
    return SearchR1Format(tokenizer).observation([list(starts.pop()) + cut.head_marker], "")


CHUNK = 16  # sequences per forward in fine_tune


def teach_search_format(
    model_dir: str | Path,
    rows: list[dict],
    *,
    steps: int = 100,
    lr: float = 5e-3,
    seed: int = 0,
    device: str = "cpu",
    tool_tokens: int = SEARCH_RESULT_TOKENS,
) -> float:
    """Fine-tune the tiny model in `model_dir` (in place) to use Search-R1's format on these verl rows:
    after the prompt it writes `<search> river </search>`, and after the search result (as the loop
    writes it with max_tool_response_length=tool_tokens, truncated on the left) it answers
    `<answer> 7 </answer>` or `<answer> 9 </answer>`, half and half. A random model never calls the
    tool; this one does, and its answers vary, so GRPO has a signal. Returns the last loss.
    """
    from trainer.model import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))  # the trainer's: it keeps the char tokenizer intact
    information = search_information(tokenizer, tool_tokens)
    pairs: list[tuple[list[int], list[int]]] = []  # (context ids, target ids)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    for index, row in enumerate(rows):
        prompt = encode(
            tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        )
        search = encode(SEARCH_TURN)
        pairs.append((prompt, search))
        # ids side by side, as the loop appends them: a BPE tokenizer merges across the joins of the text
        pairs.append((prompt + search + information, encode(ANSWERS[index % 2])))
    sequences = [(context + target, [0] * len(context) + [1] * len(target)) for context, target in pairs]
    return fine_tune(
        model_dir, sequences, pad_id=tokenizer.pad_token_id, steps=steps, lr=lr, seed=seed, device=device
    )


def fine_tune(
    model_dir: str | Path,
    sequences: list[tuple[list[int], list[int]]],
    *,
    pad_id: int,
    steps: int,
    lr: float,
    seed: int = 0,
    device: str = "cpu",
) -> float:
    """Full-batch AdamW on (token ids, loss mask) sequences, the loss on the tokens the mask marks 1
    (the model's own); the model in `model_dir` is overwritten. Returns the last loss."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_id)
    labels = torch.full((len(sequences), width), -100)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), -100)
        attention[i, : len(ids)] = 1
    input_ids, labels, attention = input_ids.to(device), labels.to(device), attention.to(device)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # Chunks of CHUNK sequences with their gradients accumulated: the whole batch's logits at once ran
    # a 0.5B shape out of memory at 100 prompts. Each chunk's mean loss is weighted by its share of the
    # label tokens, so the step is the full batch's (and one chunk, the tests' case, is exactly it).
    targets = (labels[:, 1:] != -100).sum(dim=1)
    total = targets.sum()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.zeros(())
        for s in range(0, len(sequences), CHUNK):
            part = slice(s, s + CHUNK)
            chunk = model(input_ids=input_ids[part], attention_mask=attention[part], labels=labels[part]).loss
            weighted = chunk * (targets[part].sum() / total)
            weighted.backward()
            loss = loss + weighted.detach().cpu()
        optimizer.step()
    model.save_pretrained(model_dir)
    return float(loss)
