"""Write verl-ready parquet: the exact schema of verl's examples/data_preprocess/gsm8k.py."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# Column order and nested field names/types as verl's preprocessing (via `datasets`) writes them.
VERL_GSM8K_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("answer", pa.string()),
                    ("index", pa.int64()),
                    ("question", pa.string()),
                    ("split", pa.string()),
                ]
            ),
        ),
    ]
)


def write_verl_parquet(rows: list[dict], path: Path) -> None:
    """rows: verl rows as built by sources.gsm8k_row (a `uid` or extra keys are dropped)."""
    columns = {
        "data_source": [r["data_source"] for r in rows],
        "prompt": [[{"content": m["content"], "role": m["role"]} for m in r["prompt"]] for r in rows],
        "ability": [r["ability"] for r in rows],
        "reward_model": [
            {"ground_truth": r["reward_model"]["ground_truth"], "style": r["reward_model"]["style"]}
            for r in rows
        ],
        "extra_info": [
            {k: r["extra_info"][k] for k in ("answer", "index", "question", "split")} for r in rows
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.table(columns, schema=VERL_GSM8K_SCHEMA), tmp)
    tmp.replace(path)
