"""Search-R1 with GRPO: the share of a training step spent in tool calls, and tokens/s with tools on vs off.

    python bench/search_r1.py --smoke                    # CPU: a tiny model, 2 steps per arm (plumbing)
    python bench/search_r1.py [--model DIR] [--steps 6]  # GPU: HotpotQA questions and paragraphs

Two arms on the same prompts, model and budget, each a real `python -m jobgroup.local run` (data-,
reward- and, for the tools arm, retrieval-server on loopback, then `python -m trainer.main_ppo`):
  tools     Search-R1 tags, up to 4 model turns: a trajectory searches the retrieval-server and goes on
  no-tools  the same loop and engine, one model turn: it stops at the closed call and no search runs
            (both arms run the agent loop on the built-in engine, so the engine is not what differs)
Per arm, the mean over the steps after the first (the first includes warm-up) of: step time,
generation time, timing_s/tool_calls (wall time with a search in flight) and its share of the step,
the model's own tokens per step (response_length/mean x sequences: search results not counted) and
those tokens per second of generation, perf/throughput (all tokens of the step per second), turns and
tool calls per trajectory, /retrieve requests per step.

Without --model the GPU run uses a random model of Qwen2.5-0.5B's shape (no hub needed) that is
first taught Search-R1's format on a few prompts (testing/search.py), so it does call the tool; a
real instruct model (--model, a local folder) follows the instruction on its own. Data: the
question + golden_answers .jsonl named by --qa (the data-server adds Search-R1's instruction) and the
corpus .jsonl named by --corpus (indexed with BM25, or --index flat: MiniLM + FAISS).
Writes OUT/results.json and prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from testing.search import SEARCH_RESULT_TOKENS  # noqa: E402 - after the path insert

WIKI = ROOT.parent / "shared" / "data" / "wiki"


def prepare_smoke(out: Path) -> tuple[Path, Path, Path, str]:
    """A tiny char model taught the format, short QA rows, the made-up corpus of testing/search.py."""
    from testing.search import short_search_row, teach_search_format, write_corpus
    from testing.tiny import make_tiny_model

    model = out / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, seed=0, tokenizer="char")
        teach_search_format(model, [short_search_row(i) for i in range(6)])
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, indexes in (("train", range(6, 38)), ("test", range(4))):  # the trainer opens both splits
        (data / f"{split}.jsonl").write_text("".join(json.dumps(short_search_row(i)) + "\n" for i in indexes))
    return model, data, write_corpus(out / "corpus.jsonl"), "nq"


def prepare_gpu(out: Path, model: Path | None, qa: Path, corpus: Path) -> tuple[Path, Path, Path, str]:
    """HotpotQA-style rows served as dataset `hotpotqa` (the reward-server's exact match) and a model."""
    from services.data_server.sources import qa_row, read_records

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    qa_rows = read_records(qa)
    lines = [
        json.dumps({"question": r["question"], "golden_answers": r["golden_answers"]}) + "\n" for r in qa_rows
    ]
    (data / "train.jsonl").write_text("".join(lines))
    (data / "test.jsonl").write_text("".join(lines[:8]))  # the trainer opens both splits
    if model is None:
        from testing.search import teach_search_format
        from testing.tiny import make_tiny_model, qwen25_05b_config

        model = out / "model"
        if not (model / "config.json").exists():
            make_tiny_model(model, config=qwen25_05b_config(), tokenizer="qwen")
            rows = [
                qa_row(r["question"], r["golden_answers"], "train", i, "hotpotqa")
                for i, r in enumerate(qa_rows[:8])
            ]
            teach_search_format(model, rows, device="cuda")
    return model, data, corpus, "hotpotqa"


def build_index(corpus: Path, out: Path, kind: str) -> Path:
    index = out / f"index-{kind}"
    if not (index / "manifest.json").exists():
        subprocess.run(
            [sys.executable, "-m", "services.retrieval_server", "build", "--corpus", str(corpus),
             "--out", str(index), "--index", kind, "--no-progress"],
            cwd=ROOT, check=True,
        )  # fmt: skip
    return index


def run_arm(
    name: str, *, tools: bool, out: Path, index: Path, data: Path, dataset: str, keys: list[str]
) -> list[dict]:
    """One `python -m jobgroup.local run`; -> the metrics rows of its training steps."""
    run_dir = out / name
    launcher = [
        sys.executable, "-m", "jobgroup.local", "run", "--run-dir", str(run_dir / "group"),
        "--data-port", "0", "--reward-port", "0", "--retrieval-port", "0", "--health-timeout", "600",
        "--data-server-args", f"--datasets {dataset}={data}",
    ]  # fmt: skip
    # Both arms run the agent loop on the built-in engine, so only the tools differ: the no-tools arm
    # ends every trajectory after its first model turn (which stops at a closed call: no search runs).
    launcher += ["--retrieval-index", str(index)]
    turns = 4 if tools else 1
    trainer = keys + [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={turns}",
        f"data.dataset={dataset}",
        "trainer.logger=[console,jsonl]",
        f"trainer.log_dir={run_dir / 'log'}",
        f"trainer.default_local_dir={run_dir / 'ckpt'}",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "USE_RETRIEVAL"}
    subprocess.run(launcher + trainer, cwd=ROOT, env=env, check=True)
    rows = [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "timing_s/step" in row]


def summary(rows: list[dict], sequences: int) -> dict:
    """Means over the steps after the first (all steps when there is only one)."""
    kept = rows[1:] or rows

    def mean(key: str) -> float:
        return statistics.fmean(row.get(key, 0.0) for row in kept)

    model_tokens = mean("response_length/mean") * sequences
    step, gen, tool = mean("timing_s/step"), mean("timing_s/gen"), mean("timing_s/tool_calls")
    return {
        "steps": len(kept),
        "step_s": step,
        "gen_s": gen,
        "tool_s": tool,
        "tool_share_of_step": tool / step if step else 0.0,
        "model_tokens_per_step": model_tokens,
        "gen_model_tokens_per_s": model_tokens / gen if gen else 0.0,
        "throughput_tokens_per_s": mean("perf/throughput"),
        "num_turns_mean": mean("num_turns/mean"),
        "tool_calls_mean": mean("tool_calls/mean"),
        "retrieve_requests_per_step": mean("tool/retrieve_requests"),
        "tool_errors": sum(row.get("tool/errors", 0.0) for row in kept),
        "reward_mean": mean("critic/score/mean"),
    }


def table(results: dict) -> str:
    columns = (
        "arm, step s, gen s, tool s (share), model tok/step, gen tok/s, all tok/s, turns, calls, requests"
    )
    lines = ["| " + " | ".join(columns.split(", ")) + " |", "|---" * 10 + "|"]
    for arm, r in results.items():
        cells = [
            arm,
            f"{r['step_s']:.2f}",
            f"{r['gen_s']:.2f}",
            f"{r['tool_s']:.2f} ({r['tool_share_of_step']:.1%})",
            f"{r['model_tokens_per_step']:.0f}",
            f"{r['gen_model_tokens_per_s']:.0f}",
            f"{r['throughput_tokens_per_s']:.0f}",
            f"{r['num_turns_mean']:.2f}",
            f"{r['tool_calls_mean']:.2f}",
            f"{r['retrieve_requests_per_step']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU: tiny model, made-up corpus, 2 steps per arm"
    )
    parser.add_argument(
        "--model", type=Path, help="local HF model folder (default: a taught random 0.5B shape)"
    )
    parser.add_argument("--qa", type=Path, default=WIKI / "hotpot_dev100_qa.jsonl")
    parser.add_argument("--corpus", type=Path, default=WIKI / "hotpot_dev100_corpus.jsonl")
    parser.add_argument("--index", choices=["bm25", "flat"], default="bm25")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="prompts per step")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_search_r1")
    args, extra = parser.parse_known_args()
    if args.smoke:
        args.steps, args.batch, args.n, args.response_length = 2, 4, 4, 128
        model, data, corpus, dataset = prepare_smoke(args.out)
        device, prompt_length, tool_length = "cpu", 128, SEARCH_RESULT_TOKENS  # as the tiny model was taught
    else:
        model, data, corpus, dataset = prepare_gpu(args.out, args.model, args.qa, args.corpus)
        device, prompt_length, tool_length = "cuda", 512, 256
    index = build_index(corpus, args.out, args.index)
    keys = [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_batch_size={args.batch}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={args.response_length}",
        "data.truncation=left",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.name=builtin",
        "actor_rollout_ref.rollout.multi_turn.format=search_r1",
        f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={tool_length}",
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
        f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        f"trainer.device={device}",
        *extra,
    ]
    sequences = args.batch * args.n
    results = {
        arm: summary(
            run_arm(arm, tools=tools, out=args.out, index=index, data=data, dataset=dataset, keys=keys),
            sequences,
        )
        for arm, tools in (("tools", True), ("no-tools", False))
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"(results: {args.out / 'results.json'})")


if __name__ == "__main__":
    main()
