"""Recall of the gold passage for each index kind, on real Wikipedia questions (../shared/data/wiki).

SQuAD v1.1 dev: the first 2000 questions whose gold paragraph is in the 2067-paragraph corpus;
recall@k = share of questions whose gold paragraph is among the top k. HotpotQA dev slice
(103 questions, 1021 paragraphs): a hit when any gold paragraph is in the top k.

The indexes are built with the CLI into --work-dir (flat embeds the corpus in float32; HNSW and
IVF-PQ reuse its vectors; BM25 embeds nothing) and searched with the server's own searchers.
Flat is scored twice: float32 queries, and the server's default (bfloat16 on CPUs with AMX).

    .venv/bin/python bench/retrieval_quality.py [--work-dir /tmp/retrieval_bench] [--no-hotpot]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WIKI = ROOT.parent / "shared" / "data" / "wiki"
KINDS = ("flat", "hnsw", "ivfpq", "bm25")

from services.retrieval_server.core import load_retriever
from services.retrieval_server.embedder import default_threads, set_threads


def build_all(corpus: Path, work_dir: Path, name: str) -> dict[str, Path]:
    folders = {kind: work_dir / f"{name}_{kind}" for kind in KINDS}
    for kind in KINDS:
        if (folders[kind] / "manifest.json").exists():
            continue
        extra = ["--vectors-from", str(folders["flat"])] if kind in ("hnsw", "ivfpq") else []
        started = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "services.retrieval_server",
                "build",
                "--corpus",
                str(corpus),
                "--out",
                str(folders[kind]),
                "--index",
                kind,
                "--overwrite",
                *extra,
            ],
            cwd=ROOT,
            check=True,
        )
        print(f"built {folders[kind]} in {time.perf_counter() - started:.1f}s", flush=True)
    return folders


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def ranked_ids(
    folder: Path, questions: list[str], topk: int, precision: str
) -> tuple[list[list[str]], float]:
    """Top-k passage ids per question, and queries/s of embed + search (one thread, batches of 64)."""
    retriever = load_retriever(folder, precision=precision, threads=default_threads())
    ids = [retriever.store.get(i)["id"] for i in range(len(retriever.store))]
    ranked: list[list[str]] = []
    started = time.perf_counter()
    for start in range(0, len(questions), 64):
        encoded = retriever.searcher.encode(questions[start : start + 64])
        _, rows = retriever.searcher.search(encoded, topk)
        ranked.extend([ids[r] for r in row if r >= 0] for row in rows.tolist())
    rate = len(questions) / (time.perf_counter() - started)
    retriever.close()
    return ranked, rate


def recall(ranked: list[list[str]], gold: list[set[str]], k: int) -> float:
    return float(np.mean([bool(set(r[:k]) & g) for r, g in zip(ranked, gold)]))


def evaluate(name: str, folders: dict[str, Path], questions: list[str], gold: list[set[str]]) -> list[dict]:
    rows = []
    runs = [("flat", "float32")] + [(kind, "auto") for kind in KINDS]
    for kind, precision in runs:
        ranked, rate = ranked_ids(folders[kind], questions, 5, precision)
        manifest = json.loads((folders[kind] / "manifest.json").read_text())
        row = {
            "data": name,
            "index": kind,
            "queries": precision if kind != "bm25" else "-",
            "recall@1": round(recall(ranked, gold, 1), 4),
            "recall@5": round(recall(ranked, gold, 5), 4),
            "queries_per_s": round(rate),
            "params": manifest["params"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def squad(work_dir: Path, limit: int) -> list[dict]:
    corpus = WIKI / "squad_dev_corpus.jsonl"
    passage_ids = {row["id"] for row in read_jsonl(corpus)}
    qa = [q for q in read_jsonl(WIKI / "squad_dev_qa.jsonl") if q["gold_passage_id"] in passage_ids][:limit]
    folders = build_all(corpus, work_dir, "squad")
    return evaluate("squad-dev", folders, [q["question"] for q in qa], [{q["gold_passage_id"]} for q in qa])


def hotpot(work_dir: Path) -> list[dict]:
    corpus = WIKI / "hotpot_dev100_corpus.jsonl"
    qa = read_jsonl(WIKI / "hotpot_dev100_qa.jsonl")
    folders = build_all(corpus, work_dir, "hotpot")
    return evaluate(
        "hotpot-dev103", folders, [q["question"] for q in qa], [set(q["gold_passage_ids"]) for q in qa]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/retrieval_bench"))
    parser.add_argument("--questions", type=int, default=2000)
    parser.add_argument("--no-hotpot", dest="hotpot", action="store_false")
    args = parser.parse_args()
    if not (WIKI / "squad_dev_corpus.jsonl").exists():
        sys.exit(f"error: {WIKI} is not here")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    set_threads(default_threads())
    rows = squad(args.work_dir, args.questions) + (hotpot(args.work_dir) if args.hotpot else [])
    print("\n| data | index | query precision | recall@1 | recall@5 | queries/s (1 thread) | params |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['data']} | {r['index']} | {r['queries']} | {r['recall@1']:.3f} | {r['recall@5']:.3f} | "
            f"{r['queries_per_s']} | {r['params'] or ''} |"
        )


if __name__ == "__main__":
    main()
