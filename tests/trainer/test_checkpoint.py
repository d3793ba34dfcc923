"""Checkpoints: exact save -> load round trip, verl's layout, crash safety, keep-last-K, resume modes."""

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trainer.checkpoint import (
    LATEST_FILE,
    CheckpointError,
    CheckpointWriteError,
    LocalRole,
    TrainState,
    capture_rng_state,
    find_resume_checkpoint,
    load_checkpoint,
    load_train_state,
    restore_rng_state,
    save_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]


class TiedLM(nn.Module):
    """Embedding -> MLP -> head whose weight IS the embedding (like tie_word_embeddings)."""

    def __init__(self, vocab: int = 11, hidden: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 16), nn.GELU(), nn.Linear(16, hidden))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("running_scale", torch.ones(hidden))

    def forward(self, ids):
        hidden = self.embed(ids)
        return self.head(hidden + self.mlp(hidden) * self.running_scale)


class Exploding(nn.Module):
    """A model whose weights cannot be read: the save fails after earlier roles were written."""

    def state_dict(self, *args, **kwargs):
        raise RuntimeError("disk on fire")


def make_trainables(seed: int, device: str = "cpu"):
    torch.manual_seed(seed)
    model = TiedLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # warm-up then constant: the scheduler's step count changes the lr, so a lost count shows up
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, ids):
    logits = model(ids)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.roll(1, dims=-1).reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def draw_random():
    return (
        random.random(),
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


def save(root, step, model, optimizer, scheduler, keep_last=None, **state_fields):
    return save_checkpoint(
        root,
        step,
        roles={"actor": LocalRole(model, optimizer, scheduler)},
        state=TrainState(step=step, **state_fields),
        keep_last=keep_last,
    )


def test_round_trip_restores_weights_moments_scheduler_and_rng(tmp_path):
    model, optimizer, scheduler = make_trainables(seed=0)
    ids = torch.randint(0, 11, (4, 6))
    for _ in range(3):
        train_step(model, optimizer, scheduler, ids)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = save(
        tmp_path,
        3,
        model,
        optimizer,
        scheduler,
        data_cursor="0.24.abc",
        tracker_run_id="run42",
        extra={"kl_coef": 0.001},
    )
    expected_draws = draw_random()
    train_step(model, optimizer, scheduler, ids)  # the "straight" run continues one more step
    expected_params = {name: p.detach().clone() for name, p in model.named_parameters()}

    restored, restored_opt, restored_sched = make_trainables(seed=123)  # different init, no optimizer state
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    state = load_checkpoint(path, roles={"actor": LocalRole(restored, restored_opt, restored_sched)})

    assert state == TrainState(
        step=3, data_cursor="0.24.abc", tracker_run_id="run42", extra={"kl_coef": 0.001}
    )
    assert draw_random() == expected_draws  # next random numbers of every stream are equal
    assert restored_sched.last_epoch == 3
    assert restored_opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 4 / 5)
    assert restored.head.weight is restored.embed.weight  # the tie survives loading
    first = next(iter(restored_opt.state.values()))
    assert float(first["step"]) == 3.0 and first["exp_avg"].abs().sum() > 0
    train_step(restored, restored_opt, restored_sched, ids)
    for name, param in restored.named_parameters():
        # bitwise equal only if weights, Adam moments, step counts and lr all came back exactly
        assert torch.equal(param, expected_params[name]), name


def test_layout_follows_verl_and_tied_weights_are_stored_once(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    model, optimizer, scheduler = make_trainables(seed=0)
    path = save(tmp_path, 7, model, optimizer, scheduler, tracker_run_id="abc")
    assert path == tmp_path / "global_step_7"
    assert (tmp_path / LATEST_FILE).read_text().strip() == "7"
    assert sorted(p.name for p in path.iterdir()) == ["actor", "rng_state.pt", "trainer_state.json"]
    # torch.distributed.checkpoint: one data file per writing rank (one here) and the metadata
    assert sorted(p.name for p in (path / "actor").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "scheduler.pt",
        "tied.json",
    ]
    record = json.loads((path / "trainer_state.json").read_text())
    assert record["step"] == 7 and record["tracker_run_id"] == "abc" and record["roles"] == ["actor"]
    assert json.loads((path / "actor" / "tied.json").read_text()) == {"head.weight": "embed.weight"}
    keys = set(FileSystemReader(str(path / "actor")).read_metadata().state_dict_metadata)
    assert "model.head.weight" not in keys and {"model.embed.weight", "model.running_scale"} <= keys
    assert any(key.startswith("optimizer.state.") for key in keys)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp leftovers
    assert load_train_state(path).tracker_run_id == "abc"


def test_failed_save_leaves_previous_checkpoint_usable(tmp_path):
    model, optimizer, scheduler = make_trainables(seed=0)
    save(tmp_path, 1, model, optimizer, scheduler)
    saved = {name: t.clone() for name, t in model.state_dict().items()}
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="disk on fire"):
        # actor's files are written, then the critic blows up half-way through the checkpoint
        save_checkpoint(
            tmp_path,
            2,
            roles={"actor": LocalRole(model, optimizer), "critic": LocalRole(Exploding())},
            state=TrainState(step=2),
            keep_last=None,
        )
    assert (tmp_path / LATEST_FILE).read_text().strip() == "1"
    assert not (tmp_path / "global_step_2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", LATEST_FILE]  # temp dir removed
    found = find_resume_checkpoint(tmp_path, "auto", None)
    assert found == tmp_path / "global_step_1"
    fresh, fresh_opt, fresh_sched = make_trainables(seed=9)
    load_checkpoint(found, roles={"actor": LocalRole(fresh, fresh_opt, fresh_sched)})
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


CRASHING_SAVE = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    from trainer.checkpoint import LocalRole, TrainState, save_checkpoint

    class DiesMidSave(nn.Module):
        def state_dict(self, *args, **kwargs):
            os._exit(17)   # a hard crash: no exception handler, no cleanup runs

    root = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    save_checkpoint(root, 1, roles={"actor": LocalRole(model)},
                    state=TrainState(step=1, data_cursor="c1"), keep_last=2)
    with torch.no_grad():
        model.weight.add_(1.0)
    roles = {"actor": LocalRole(model), "zz_critic": LocalRole(DiesMidSave())}
    save_checkpoint(root, 2, roles=roles, state=TrainState(step=2, data_cursor="c2"), keep_last=2)
""")


def test_hard_crash_mid_save_is_never_picked_up(tmp_path):
    """A process killed while writing step 2 leaves a temp dir; resume still finds step 1."""
    result = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 17, result.stderr
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-global_step_2")]
    assert len(leftovers) == 1 and (leftovers[0] / "actor" / ".metadata").is_file()  # really mid-save
    assert (tmp_path / LATEST_FILE).read_text().strip() == "1"
    found = find_resume_checkpoint(tmp_path, "auto", None)
    assert found == tmp_path / "global_step_1"
    model = nn.Linear(4, 3)
    state = load_checkpoint(found, roles={"actor": LocalRole(model)})
    torch.manual_seed(0)
    assert state.data_cursor == "c1" and torch.equal(model.weight, nn.Linear(4, 3).weight)
    # the next save of step 2 succeeds and sweeps the crashed attempt away
    save_checkpoint(tmp_path, 2, roles={"actor": LocalRole(model)}, state=TrainState(step=2), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "global_step_2", LATEST_FILE]


def test_keep_last_prunes_oldest_complete_only(tmp_path):
    model, optimizer, scheduler = make_trainables(seed=0)
    for step in range(1, 6):
        save(tmp_path, step, model, optimizer, scheduler, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_4", "global_step_5", LATEST_FILE]
    # re-saving an OLDER step (after resuming from it) never deletes the checkpoint just written
    save(tmp_path, 3, model, optimizer, scheduler, keep_last=1)
    assert (tmp_path / "global_step_3").is_dir() and (tmp_path / LATEST_FILE).read_text().strip() == "3"
    assert not (tmp_path / "global_step_4").exists() and (tmp_path / "global_step_5").exists()
    # keep_last None keeps everything
    for step in (6, 7, 8):
        save(tmp_path, step, model, optimizer, scheduler, keep_last=None)
    assert len(list(tmp_path.glob("global_step_*"))) == 5


def test_resaving_the_same_step_replaces_it(tmp_path):
    model, optimizer, scheduler = make_trainables(seed=0)
    save(tmp_path, 2, model, optimizer, scheduler, data_cursor="first")
    save(tmp_path, 2, model, optimizer, scheduler, data_cursor="second")
    assert load_train_state(tmp_path / "global_step_2").data_cursor == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", LATEST_FILE]


def test_resume_modes(tmp_path):
    root = tmp_path / "ckpt"
    assert find_resume_checkpoint(root, "auto", None) is None  # nothing yet: fresh start
    model, optimizer, scheduler = make_trainables(seed=0)
    save(root, 1, model, optimizer, scheduler)
    save(root, 2, model, optimizer, scheduler)
    assert find_resume_checkpoint(root, "auto", None) == root / "global_step_2"
    assert find_resume_checkpoint(root, "disable", None) is None
    assert find_resume_checkpoint(root, "resume_path", str(root / "global_step_1")) == root / "global_step_1"
    assert find_resume_checkpoint(root, "resume_path", str(root)) == root / "global_step_2"
    missing = tmp_path / "nope" / "global_step_9"
    with pytest.raises(CheckpointError, match="nope/global_step_9"):
        find_resume_checkpoint(root, "resume_path", str(missing))
    with pytest.raises(CheckpointError, match="resume_from_path"):
        find_resume_checkpoint(root, "resume_path", None)
    (root / "global_step_5").mkdir()  # a directory without trainer_state.json
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        find_resume_checkpoint(root, "resume_path", str(root / "global_step_5"))
    with pytest.raises(ValueError, match="resume_mode"):
        find_resume_checkpoint(root, "sometimes", None)
    assert find_resume_checkpoint(root, "auto", None) == root / "global_step_2"  # incomplete step 5 ignored


def test_latest_file_is_the_authority(tmp_path):
    model, optimizer, scheduler = make_trainables(seed=0)
    save(tmp_path, 1, model, optimizer, scheduler)
    save(tmp_path, 2, model, optimizer, scheduler)
    (tmp_path / LATEST_FILE).write_text(
        "1\n"
    )  # as if the process died between the rename and the latest update
    assert find_resume_checkpoint(tmp_path, "auto", None) == tmp_path / "global_step_1"
    shutil.rmtree(tmp_path / "global_step_1")  # latest names a directory that is gone: newest complete one
    assert find_resume_checkpoint(tmp_path, "auto", None) == tmp_path / "global_step_2"


def test_role_mismatches_are_named(tmp_path):
    model, optimizer, scheduler = make_trainables(seed=0)
    path = save(tmp_path, 1, model, optimizer, scheduler)
    with pytest.raises(CheckpointError, match="'critic'"):
        load_checkpoint(path, roles={"critic": LocalRole(TiedLM())})
    with pytest.raises(CheckpointError, match="does not match the model"):
        load_checkpoint(path, roles={"actor": LocalRole(nn.Linear(8, 11))})


@pytest.mark.gpu
def test_cuda_model_optimizer_and_cuda_rng_round_trip(tmp_path):
    device = torch.device("cuda")
    model, optimizer, scheduler = make_trainables(seed=0, device="cuda")
    ids = torch.randint(0, 11, (4, 6), device=device)
    train_step(model, optimizer, scheduler, ids)
    torch.cuda.manual_seed_all(3)
    path = save(tmp_path, 1, model, optimizer, scheduler)
    expected_cuda_draw = torch.rand(5, device=device).tolist()
    train_step(model, optimizer, scheduler, ids)

    restored, restored_opt, restored_sched = make_trainables(seed=1, device="cuda")
    torch.cuda.manual_seed_all(77)
    load_checkpoint(path, roles={"actor": LocalRole(restored, restored_opt, restored_sched)})
    assert torch.rand(5, device=device).tolist() == expected_cuda_draw
    assert restored.head.weight is restored.embed.weight
    assert next(iter(restored_opt.state.values()))["exp_avg"].device.type == "cuda"
    train_step(restored, restored_opt, restored_sched, ids)
    for (name, param), expected in zip(restored.named_parameters(), model.parameters()):
        # not bitwise: CUDA's embedding backward sums repeated indices in no fixed order
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-6, msg=name)


KILLED_REPLACING_LATEST = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    from trainer.checkpoint import LATEST_FILE, LocalRole, TrainState, save_checkpoint

    replace = os.replace
    def dies_on_latest(src, dst):
        if str(dst).endswith(LATEST_FILE) and str(dst).count("global_step") == 0 and "2" in open(src).read():
            os._exit(17)   # killed after the temp file of latest is written, before it replaces latest
        replace(src, dst)
    os.replace = dies_on_latest

    root, model = sys.argv[1], nn.Linear(4, 3)
    save_checkpoint(root, 1, roles={"actor": LocalRole(model)}, state=TrainState(step=1), keep_last=None)
    save_checkpoint(root, 2, roles={"actor": LocalRole(model)}, state=TrainState(step=2), keep_last=None)
""")


def test_a_kill_while_latest_is_replaced_leaves_a_temp_file_the_next_save_sweeps(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", KILLED_REPLACING_LATEST, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 17, result.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{LATEST_FILE}.")]
    assert len(leftovers) == 1  # really killed between the temp file and its rename
    assert (tmp_path / LATEST_FILE).read_text().strip() == "1"
    save_checkpoint(tmp_path, 3, roles={"actor": LocalRole(nn.Linear(4, 3))}, state=TrainState(step=3),
                    keep_last=None)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_1",
        "global_step_2",
        "global_step_3",
        LATEST_FILE,
    ]


def test_rng_state_captured_at_step_start_is_what_the_checkpoint_restores(tmp_path):
    """The loop captures the streams with the cursor at a step's start; a save after that step failed
    midway must store those, not the streams the failed step's sampling advanced."""
    model = nn.Linear(4, 3)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    at_step_start = capture_rng_state()
    expected = draw_random()  # what the step draws in the uninterrupted run
    draw_random()  # the failed step's sampling moves every stream on
    path = save_checkpoint(
        tmp_path, 1, roles={"actor": LocalRole(model)},
        state=TrainState(step=1, data_cursor="c", rng_state=at_step_start), keep_last=None,
    )  # fmt: skip
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    load_checkpoint(path, roles={"actor": LocalRole(nn.Linear(4, 3))})
    assert draw_random() == expected
    assert "rng_state" not in json.loads((path / "trainer_state.json").read_text())
    # negative control: without the captured state the save takes the streams as they are now
    path = save_checkpoint(tmp_path, 2, roles={"actor": LocalRole(model)}, state=TrainState(step=2),
                           keep_last=None)  # fmt: skip
    load_checkpoint(path, roles={"actor": LocalRole(nn.Linear(4, 3))})
    assert draw_random() != expected


def test_capture_and_restore_rng_state_round_trip_every_stream():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    np.random.standard_normal()  # numpy caches a second gaussian: that must come back too
    random.gauss(0, 1)
    state = capture_rng_state()
    expected = (draw_random(), np.random.standard_normal(), random.gauss(0, 1))
    restore_rng_state(state)
    assert (draw_random(), np.random.standard_normal(), random.gauss(0, 1)) == expected


def _make_unwritable(folder: Path) -> bool:
    """chmod for a normal user; root ignores modes, so the immutable attribute where the filesystem has
    it. False when neither makes the folder refuse a new entry."""
    folder.chmod(0o555)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False)
    try:
        (folder / ".probe").mkdir()
    except OSError:
        return True
    (folder / ".probe").rmdir()
    return False


def test_an_unwritable_checkpoint_folder_is_one_line_naming_the_last_usable_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    model = nn.Linear(4, 3)
    first = save_checkpoint(root, 1, roles={"actor": LocalRole(model)}, state=TrainState(step=1), keep_last=2)
    if not _make_unwritable(root):
        _restore_writable(root)
        pytest.skip("cannot make a folder unwritable here (root without chattr)")
    try:
        with pytest.raises(CheckpointWriteError) as caught:
            save_checkpoint(root, 2, roles={"actor": LocalRole(model)}, state=TrainState(step=2), keep_last=2)
    finally:
        _restore_writable(root)
    message = str(caught.value)
    assert "\n" not in message and "global_step_2" in message
    assert message.endswith(f"last usable checkpoint: {first}")
    assert "Permission denied" in message or "Operation not permitted" in message  # chmod or chattr
    assert caught.value.last_usable == first
    assert find_resume_checkpoint(root, "auto", None) == first


def _restore_writable(folder: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True, check=False)
    folder.chmod(0o755)


def test_save_contents_leave_out_the_optimizer_and_a_resume_asking_for_it_is_refused(tmp_path):
    """verl's checkpoint.save_contents: without "optimizer" and "extra" the role's directory holds the
    weights alone (a third of the bytes with AdamW); load_contents reads what is asked, and asking for a
    part the checkpoint lacks fails before anything is loaded, naming the key that fixes it."""
    from torch.distributed.checkpoint import FileSystemReader

    model, optimizer, scheduler = make_trainables(seed=0)
    train_step(model, optimizer, scheduler, torch.randint(0, 11, (4, 6)))
    full = save(tmp_path / "full", 1, model, optimizer, scheduler)
    roles = {"actor": LocalRole(model, optimizer, scheduler)}
    light = save_checkpoint(
        tmp_path / "light",
        1,
        roles=roles,
        state=TrainState(step=1),
        keep_last=None,
        contents={"actor": ["model"]},
    )

    def stored(path):
        keys = FileSystemReader(str(path / "actor")).read_metadata().state_dict_metadata
        size = sum(f.stat().st_size for f in (path / "actor").iterdir() if f.is_file())
        return {key.split(".")[0] for key in keys}, size

    (full_parts, full_bytes), (light_parts, light_bytes) = stored(full), stored(light)
    assert full_parts == {"model", "optimizer"} and light_parts == {"model"}
    assert light_bytes < full_bytes / 2
    assert not (light / "actor" / "scheduler.pt").exists()
    assert json.loads((light / "trainer_state.json").read_text())["contents"] == {"actor": ["model"]}

    restored, restored_opt, restored_sched = make_trainables(seed=123)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(light, roles={"actor": LocalRole(restored, restored_opt, restored_sched)})
    message = str(refused.value)
    assert "without ['optimizer', 'extra']" in message
    assert "actor_rollout_ref.actor.checkpoint.load_contents=['model']" in message
    assert not restored_opt.state  # nothing was loaded before the refusal

    load_checkpoint(
        light,
        roles={"actor": LocalRole(restored, restored_opt, restored_sched)},
        contents={"actor": ["model"]},
    )
    for name, param in restored.named_parameters():
        assert torch.equal(param, dict(model.named_parameters())[name]), name
    assert not restored_opt.state and restored_sched.last_epoch == 0  # both start fresh
