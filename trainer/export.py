"""Turn a training checkpoint's policy into a Hugging Face folder: `python -m trainer.export CKPT --out DIR`.

CKPT is a global_step_N directory or an experiment root (its latest checkpoint is used). The role's
directory must carry `huggingface/` (config, generation config, tokenizer), which `save_checkpoint`
writes when given the tokenizer (see `trainer.checkpoint.save_hf_metadata`). The output holds
config.json, model.safetensors (sharded with an index above --max-shard-size), generation_config.json
and the tokenizer files, and loads with `AutoModelForCausalLM.from_pretrained(DIR)`.

The model is rebuilt from its config on the meta device and the checkpoint tensors are assigned into
it, so exporting needs one copy of the weights in memory; transformers then writes the files, which
handles tied embeddings (lm_head stored once, re-tied on load) and sharding the way every HF tool
expects.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from trainer.checkpoint import (
    HF_METADATA_DIR,
    CheckpointError,
    is_complete,
    latest_checkpoint,
    load_role_weights,
)
from trainer.parallel.fsdp import has_sharded_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# written by save_pretrained from the rebuilt model; the checkpoint's own copies are used instead
_MODEL_FILES = {"config.json", "model.safetensors", "model.safetensors.index.json"}


def resolve_checkpoint(path: Path) -> Path:
    path = Path(path)
    if is_complete(path):
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(
            f"{str(path)!r} is neither a complete global_step_N checkpoint nor a directory holding one"
        )
    return found


def export_hf(
    checkpoint: Path, out_dir: Path, *, role: str = "actor", dtype: str = "auto", max_shard_size: str = "5GB"
) -> Path:
    """Write the role's weights of `checkpoint` as a Hugging Face model folder; returns out_dir.

    dtype "auto" keeps the dtype the config records (torch_dtype / dtype), else the stored one.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    role_dir = resolve_checkpoint(checkpoint) / role
    hf_dir = role_dir / HF_METADATA_DIR
    if not has_sharded_checkpoint(role_dir):
        raise CheckpointError(f"no {role!r} weights in {str(role_dir.parent)!r}")
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(
            f"{str(hf_dir)!r} has no config.json: save the checkpoint with the model's HF "
            "config and tokenizer (LocalRole(..., tokenizer=...): save_hf_metadata)"
        )
    config = AutoConfig.from_pretrained(hf_dir)
    state_dict = load_role_weights(role_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _check_keys(model, state_dict, role_dir)
    model.load_state_dict(state_dict, strict=True, assign=True)
    _check_tied(model, config)
    model.tie_weights()
    target_dtype = _target_dtype(dtype, config, state_dict)
    if target_dtype is not None:
        model.to(target_dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    for item in hf_dir.iterdir():
        if item.is_file() and item.name not in _MODEL_FILES:
            shutil.copy2(item, out_dir / item.name)  # tokenizer files and the trained generation config
    return out_dir


def _check_keys(model: torch.nn.Module, state_dict: dict, role_dir: Path) -> None:
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {str(role_dir)!r} do not match the architecture in its config: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def _check_tied(model: torch.nn.Module, config) -> None:
    """With tie_word_embeddings the output matrix must equal the input embedding, or re-tying would lose
    it.
    """
    if not getattr(config, "tie_word_embeddings", False):
        return
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if (
        output is not None
        and output.weight is not inputs.weight
        and not torch.equal(output.weight, inputs.weight)
    ):
        raise CheckpointError(
            "config says tie_word_embeddings=True but the checkpoint's lm_head differs from the "
            "input embedding"
        )


def _target_dtype(dtype: str, config, state_dict: dict) -> torch.dtype | None:
    if dtype != "auto":
        return DTYPES[dtype]
    fields = config.to_dict()  # "dtype" in transformers 5, "torch_dtype" before (reading the attribute warns)
    recorded = fields.get("dtype") or fields.get("torch_dtype")
    if isinstance(recorded, torch.dtype):
        return recorded
    if isinstance(recorded, str) and recorded in DTYPES:
        return DTYPES[recorded]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="global_step_N directory or experiment root")
    parser.add_argument("--out", type=Path, required=True, help="output Hugging Face folder")
    parser.add_argument("--role", default="actor", help="model role inside the checkpoint (default: actor)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPES], help="weight dtype of the export"
    )
    parser.add_argument("--max-shard-size", default="5GB", help="shard model.safetensors above this size")
    args = parser.parse_args(argv)
    try:
        out = export_hf(
            args.checkpoint, args.out, role=args.role, dtype=args.dtype, max_shard_size=args.max_shard_size
        )
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.role} of {resolve_checkpoint(args.checkpoint)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
