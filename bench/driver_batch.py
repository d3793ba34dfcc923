"""The driver's serial work between generation and the ranks' passes: each rank's message of rollouts
unpickled and unpacked (`unpack_rollouts`), their responses decoded for the scorer (`decode_responses`,
the Qwen tokenizer), the rollouts into one padded batch (`TrainBatch.from_rollouts`), the rows dealt to
the ranks (`Scatter.plan` + `select`) and their results put back (`gather_rows`), at the GRPO step of
bench/scaling.py (W x 64 prompts x 8 samples, ~90-200 prompt tokens, 256 response tokens) for W = 1, 2,
4 GPUs. The batch grows with W while a rank's share does not, so this is work weak scaling pays for.
The setup's objects are frozen out of the garbage collector's walks, as the driver's are (loop.py).

    PYTHONPATH=. python bench/driver_batch.py [--repeats 7] [--threads 4]

--threads: torch's threads (a Ray run's driver uses 4, trainer/parallel/groups.py). Each part runs
--repeats times; the median and the range in ms are printed. To compare two trees, run this file with
PYTHONPATH set to each (`git archive <commit> | tar -x -C /tmp/base`).
"""

from __future__ import annotations

import argparse
import gc
import pickle
import statistics
import time

import torch

from trainer.batch import TrainBatch
from testing.tiny import qwen_tokenizer_dir
from trainer.model import load_tokenizer
from trainer.parallel.distributed import Scatter
from trainer.rewards import decode_responses
from trainer.rollout.base import Rollout, pack_rollouts, unpack_rollouts

PROMPTS_PER_GPU, SAMPLES, RESPONSE_TOKENS = 64, 8, 256


def step_rollouts(gpus: int, seed: int = 0) -> list[Rollout]:
    generator = torch.Generator().manual_seed(seed)
    rollouts = []
    for index in range(gpus * PROMPTS_PER_GPU * SAMPLES):
        prompt_len = int(torch.randint(90, 200, (1,), generator=generator))
        rollouts.append(
            Rollout(
                prompt_ids=torch.randint(3, 150_000, (prompt_len,), generator=generator).tolist(),
                response_ids=torch.randint(3, 150_000, (RESPONSE_TOKENS,), generator=generator).tolist(),
                logprobs=(-torch.rand(RESPONSE_TOKENS, generator=generator)).tolist(),
                loss_mask=[1] * RESPONSE_TOKENS,
                finish_reason="length",
                prompt_index=index // SAMPLES,
            )
        )
    return rollouts


def timed_ms(fn, repeats: int) -> tuple[float, float, float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3, min(seconds) * 1e3, max(seconds) * 1e3


def parts_of_one_step(gpus: int, tokenizer) -> dict:
    """The timed parts at `gpus` GPUs, each a call without arguments."""
    share = PROMPTS_PER_GPU * SAMPLES
    sent = step_rollouts(gpus)
    messages = [
        pickle.dumps(pack_rollouts(sent[i : i + share]), protocol=5) for i in range(0, len(sent), share)
    ]
    rollouts = [r for message in messages for r in unpack_rollouts(pickle.loads(message))]
    batch = TrainBatch.from_rollouts(rollouts, pad_id=0)
    tokens = (batch.prompt_lengths + batch.response_lengths).tolist()
    plan = Scatter.plan(tokens, gpus)
    results = [torch.randn(len(rows), batch.response_width) for rows in plan.shards]
    del sent
    gc.collect()
    gc.freeze()
    return {
        "unpack": lambda: [unpack_rollouts(pickle.loads(message)) for message in messages],
        "decode": lambda: decode_responses(tokenizer, [r.response_ids for r in rollouts]),
        "from_rollouts": lambda: TrainBatch.from_rollouts(rollouts, pad_id=0),
        "scatter": lambda: [batch.select(list(rows)) for rows in Scatter.plan(tokens, gpus).shards],
        "gather_rows": lambda: plan.gather_rows(results, batch.response_width),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(str(qwen_tokenizer_dir()))
    print(f"{'GPUs':>4} {'rows':>5}  part: median ms (range)")
    for gpus in (1, 2, 4):
        cells = []
        for name, fn in parts_of_one_step(gpus, tokenizer).items():
            median, low, high = timed_ms(fn, args.repeats)
            cells.append(f"{name} {median:.1f} ({low:.1f}-{high:.1f})")
        rows = gpus * PROMPTS_PER_GPU * SAMPLES
        print(f"{gpus:>4} {rows:>5}  " + "; ".join(cells))
        gc.unfreeze()


if __name__ == "__main__":
    main()
