"""`python -m trainer.report` (curves PNG + summary) and `python -m trainer.export` (checkpoint -> HF
folder).
"""

import json
import struct
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from tests.helpers import ROOT
from trainer import export, report
from trainer.checkpoint import CheckpointError, LocalRole, TrainState, save_checkpoint
from testing.tiny import char_tokenizer, tiny_qwen2_config
from trainer.tracking import Tracker

# ------------------------------------------------------------------------------------------- report

SCORES = [0.1, 0.4, 0.8, 0.5, 0.6]  # steps 1..5: best 0.8 at step 3, last 0.6
VAL_ACC = {0: 0.2, 3: 0.5, 5: 0.45}  # validation before training and every 3rd step


def write_run(run_dir):
    def step_metrics(step, score):
        return {
            "critic/score/mean": score,
            "actor/pg_loss": -0.1 * step,
            "actor/entropy": 2.0 - 0.1 * step,
            "response_length/mean": 10.0 + step,
            "timing_s/gen": 1.0 + 0.1 * step,
            "timing_s/update_actor": 2.0,
        }

    with Tracker(
        ["jsonl"], project="p", experiment="e", run_dir=run_dir, config={}, total_steps=5
    ) as tracker:
        tracker.log({"val-core/synthetic/acc/mean@1": VAL_ACC[0]}, step=0)
        for step in (1, 2, 3):
            tracker.log(step_metrics(step, SCORES[step - 1]), step=step)
        tracker.log({"val-core/synthetic/acc/mean@1": VAL_ACC[3]}, step=3)
        tracker.log(step_metrics(4, 0.0), step=4)
    # the run crashed after step 4 and resumed from step 3: step 4 is logged again (the new value wins)
    with Tracker(
        ["jsonl"], project="p", experiment="e", run_dir=run_dir, config={}, total_steps=5, start_step=3
    ) as tracker:
        for step in (4, 5):
            tracker.log(step_metrics(step, SCORES[step - 1]), step=step)
        tracker.log({"val-core/synthetic/acc/mean@1": VAL_ACC[5]}, step=5)
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "critic/sco')  # a line cut short by a crash


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_draws_present_panels_and_prints_summary(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir)
    out = tmp_path / "plots" / "curves.png"
    result = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(run_dir), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "skipped 1 unreadable line" in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "6 logged steps (0..5), 7 metrics"
    assert lines[1] == "critic/score/mean: first 0.1000 (step 1), last 0.6000 (step 5), best 0.8000 (step 3)"
    assert lines[2] == (
        "val-core/synthetic/acc/mean@1: first 0.2000 (step 0), last 0.4500 (step 5), best 0.5000 (step 3)"
    )
    assert (
        "score / reward, validation accuracy, response length, policy loss, entropy, timing (s)" in lines[3]
    )
    width, height = png_size(out)  # 6 panels: 3 columns x 2 rows of 5 x 3.5 inches at 100 dpi
    assert (width, height) == (1500, 700)
    assert out.stat().st_size > 20_000
    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    assert pixels.std() > 0.05  # not a blank canvas


def test_report_series_and_errors(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_run(run_dir)
    series = report.load_metrics(run_dir / "metrics.jsonl")
    assert series["critic/score/mean"] == [(1, 0.1), (2, 0.4), (3, 0.8), (4, 0.5), (5, 0.6)]
    assert [title for title, _ in report.panels_present({"actor/grad_norm": [(1, 1.0)]})] == ["grad norm"]
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "missing/metrics.jsonl does not exist" in capsys.readouterr().err
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "metrics.jsonl").write_text('{"step": 1, "custom/thing": 3}\n')
    assert report.main([str(tmp_path / "odd")]) == 2
    assert "no known metric to plot" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- export


def tiny_policy(tie: bool = True):
    tokenizer = char_tokenizer()
    config = tiny_qwen2_config(vocab=len(tokenizer), hidden=32, layers=2, heads=4, kv_heads=2)
    config.tie_word_embeddings = tie
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    # one optimizer step, so the export must carry trained weights rather than a re-initialisation
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([tokenizer("12+30=42")["input_ids"]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, tokenizer, optimizer, ids


def test_export_cli_gives_an_hf_folder_with_identical_logits(tmp_path):
    model, tokenizer, optimizer, ids = tiny_policy(tie=True)
    root = tmp_path / "checkpoints" / "proj" / "exp"
    save_checkpoint(
        root,
        4,
        roles={"actor": LocalRole(model, optimizer, tokenizer=tokenizer)},
        state=TrainState(step=4),
        keep_last=None,
    )
    out = tmp_path / "hf"
    # the experiment root resolves to its latest checkpoint; a small shard size forces a sharded export
    result = subprocess.run(
        [sys.executable, "-m", "trainer.export", str(root), "--out", str(out), "--max-shard-size", "30KB"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "global_step_4" in result.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, re-tied on load
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    loaded_tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "2+2?"}]
    assert loaded_tokenizer.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    assert loaded_tokenizer("7*6=42")["input_ids"] == tokenizer("7*6=42")["input_ids"]
    assert loaded.generation_config.eos_token_id == model.generation_config.eos_token_id


def test_export_untied_and_bf16(tmp_path):
    model, tokenizer, _, ids = tiny_policy(tie=False)
    path = save_checkpoint(
        tmp_path / "ck",
        1,
        roles={"actor": LocalRole(model, tokenizer=tokenizer)},
        state=TrainState(step=1),
        keep_last=None,
    )
    loaded = AutoModelForCausalLM.from_pretrained(export.export_hf(path, tmp_path / "fp32"))
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    bf16 = AutoModelForCausalLM.from_pretrained(
        export.export_hf(path, tmp_path / "bf16", dtype="bfloat16"), dtype="auto"
    )
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))


def test_export_errors_name_the_problem(tmp_path, capsys):
    model, _, _, _ = tiny_policy()
    bare = torch.nn.Linear(3, 2)  # no HF config: nothing to rebuild an HF model from
    path = save_checkpoint(
        tmp_path / "ck",
        1,
        roles={"actor": LocalRole(bare), "critic": LocalRole(model)},
        state=TrainState(step=1),
        keep_last=None,
    )
    assert export.main([str(path), "--out", str(tmp_path / "o")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert export.main([str(path), "--out", str(tmp_path / "o"), "--role", "ref"]) == 2
    assert "no 'ref' weights" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="neither a complete"):
        export.export_hf(tmp_path / "nowhere", tmp_path / "o")
    # critic saved without tokenizer still exports (config only); tokenizer files are then simply absent
    out = export.export_hf(path, tmp_path / "critic_hf", role="critic")
    assert (out / "config.json").is_file() and not (out / "tokenizer.json").exists()


def test_flat_panels_are_dropped_and_one_point_is_kept():
    series = {
        "actor/ppo_kl": [(1, 0.0), (2, 0.0), (3, 0.0)],  # no KL term: 0 by construction
        "actor/pg_loss": [(1, 0.1), (2, -0.2), (3, 0.05)],
        "actor/grad_norm": [(1, 1.0)],
    }
    assert [title for title, _ in report.panels_present(series)] == ["policy loss", "grad norm"]
    series["actor/kl_loss"] = [(1, 0.0), (2, 0.01), (3, 0.02)]  # one line that moves keeps the panel
    assert "KL" in [title for title, _ in report.panels_present(series)]


def test_demo_summary_says_standard_errors():
    from jobgroup.demo import standard_errors

    # the larger binomial spread, sqrt(0.5 * 0.5 / 256) = 0.03125: 3.1 points; (0.5 - 0.3) / 0.03125 = 6.4
    assert standard_errors(0.30, 0.50) == (
        "256 problems, one standard error is 3.1 points: a change of +6.4 standard errors"
    )
