"""Atomic training checkpoints, verl's layout: save, find the one to resume from, load, keep the last K.

Layout (root = checkpoints/{project}/{experiment}):

    root/latest_checkpointed_iteration.txt        "N": the newest complete checkpoint (verl's file name)
    root/global_step_N/
        trainer_state.json                        step, data cursor, tracker run id, extra, each role's
                                                  contents; written LAST, so its presence marks a
                                                  complete directory
        rng_state.pt                              the driver's python, numpy, torch CPU and CUDA generators
        actor/  (one directory per model role: actor, critic, ...)
            .metadata, __<rank>_0.distcp          torch.distributed.checkpoint: the weights ("model.*")
                                                  and AdamW state ("optimizer.*"), one file per rank
                                                  that wrote it, plus the global shape of every tensor
            tied.json                             {alias: stored name} for tied weights (stored once)
            scheduler.pt                          the LR schedule's state_dict()
            huggingface/                          config.json, generation_config.json, tokenizer files
                                                  (only for Hugging Face models; `trainer.export` needs them),
                                                  and with hf_model the weights (model.safetensors)

What a role's directory holds is verl's `checkpoint.save_contents` of the role: "model" always,
"optimizer" (the AdamW state), "extra" (scheduler.pt), "hf_model" (the loadable transformers folder).
A resume reads `load_contents`, and stops with an error if it asks for what the checkpoint lacks.

Any number of ranks resumes a checkpoint written by any other number (trainer/parallel/fsdp.py): the files
describe whole tensors and each loading rank reads the slices it holds. One process without Ray
writes and reads the very same files, so a run saved on 8 GPUs resumes on a CPU and vice versa.

Why it survives a crash: everything is written into a hidden temp directory beside the target and
fsynced, then renamed to global_step_N in one `os.rename`; only then is `latest_checkpointed_iteration.txt`
replaced (write temp + fsync + `os.replace`). A crash at any point leaves either the old checkpoint
(latest still names it) or the new one, never a half-written global_step_N that resume could pick:
temp directories start with "." and are swept by the next save, and a directory without
trainer_state.json is never treated as a checkpoint. Ranks on other nodes write into the same temp
directory, so multi-node runs need a checkpoint folder every node sees (a shared or mounted bucket).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch import nn

from trainer.parallel.fsdp import has_sharded_checkpoint, load_full_model_state, load_sharded, save_sharded

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state.pt"
SCHEDULER_FILE = "scheduler.pt"
TIED_FILE = "tied.json"
DCP_METADATA_FILE = ".metadata"
HF_METADATA_DIR = "huggingface"
FORMAT_VERSION = 2  # 1: whole-tensor safetensors + torch.save'd optimizer; 2: torch.distributed.checkpoint
ALL_CONTENTS = ("model", "optimizer", "extra")  # verl's default save_contents; a record without "contents"
_CONFIG_KEY = {"actor": "actor_rollout_ref.actor", "critic": "critic"}  # where a role's checkpoint keys live

_STEP_DIR = re.compile(r"^global_step_(\d+)$")

ResumeMode = Literal["auto", "disable", "resume_path"]


@dataclass
class TrainState:
    """What the loop needs besides tensors to continue exactly where it stopped."""

    step: int
    data_cursor: str | None = None
    tracker_run_id: str | None = None
    extra: dict = field(default_factory=dict)  # anything JSON-serialisable (e.g. KL controller value)
    # The driver's RNG streams as `capture_rng_state()` returned them when `data_cursor` was read (the
    # start of the step after `step`). None: save_checkpoint captures them at save time. A save made
    # after a step failed midway must pass the start-of-step state, or the resumed run samples from
    # streams the failed step already advanced. Stored in rng_state.pt, not in trainer_state.json.
    rng_state: dict | None = field(default=None, compare=False, repr=False)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not match the models it is loaded into."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a folder turned unwritable, a full disk). The message is one line
    that names the folder, the OS error and the last usable checkpoint; nothing half-written is left
    where resume would look."""

    def __init__(self, message: str, last_usable: Path | None) -> None:
        super().__init__(message)
        self.last_usable = last_usable


# ----------------------------------------------------------------------------------------------- save


class RoleState(Protocol):
    """What a checkpoint asks of a role: write its state into a directory, and read it back.

    `LocalRole` does it for a model trained in this process; the Ray role groups
    (trainer/parallel/groups.py) do it with all their ranks writing into the same directory.
    """

    def save(self, directory: str, contents: Sequence[str] = ALL_CONTENTS) -> None: ...

    def load(self, directory: str, contents: Sequence[str] = ALL_CONTENTS) -> None: ...


@dataclass
class LocalRole:
    """A role trained in this process: its model, and optionally its optimizer, LR schedule and tokenizer."""

    model: nn.Module
    optimizer: Any = None
    scheduler: Any = None
    tokenizer: Any = None  # saved with the HF config, so `trainer.export` can build a loadable folder

    def save(self, directory: str, contents: Sequence[str] = ALL_CONTENTS) -> None:
        save_role_state(
            Path(directory),
            self.model,
            self.optimizer,
            self.scheduler,
            tokenizer=self.tokenizer,
            contents=contents,
        )

    def load(self, directory: str, contents: Sequence[str] = ALL_CONTENTS) -> None:
        load_role_state(Path(directory), self.model, self.optimizer, self.scheduler, contents=contents)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    roles: Mapping[str, RoleState],
    state: TrainState,
    keep_last: int | None,
    contents: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """Write root/global_step_{step}/ atomically, point latest at it, prune to `keep_last`; returns the dir.

    Each role writes its own directory (`RoleState.save`) with its `contents` (default: ALL_CONTENTS).
    `keep_last` None or <= 0 keeps all.
    """
    contents = {name: list(contents.get(name, ALL_CONTENTS) if contents else ALL_CONTENTS) for name in roles}
    root = Path(root)
    final = root / f"global_step_{step}"
    rng_state = state.rng_state if state.rng_state is not None else capture_rng_state()
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".tmp-global_step_{step}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    except OSError as exc:
        raise checkpoint_write_error(root, step, exc) from exc
    try:
        for name, role in roles.items():
            role.save(str(staging / name), contents[name])
        torch.save(rng_state, staging / RNG_FILE)
        # trainer_state.json last: its presence is what makes a directory a complete checkpoint.
        _write_json(staging / STATE_FILE, _state_record(state, step, contents))
        _fsync_tree(staging)
        _move_into_place(staging, final)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        os_error = _os_error_in(exc)
        if os_error is not None:
            raise checkpoint_write_error(root, step, os_error) from exc
        raise
    try:
        _write_latest(root, step)
    except OSError as exc:  # global_step_N is complete; latest_checkpoint() falls back to it
        raise checkpoint_write_error(root, step, exc) from exc
    prune_checkpoints(root, keep_last, protect=final)
    return final


def checkpoint_write_error(root: Path, step: int, exc: OSError) -> CheckpointWriteError:
    """One line for an OSError while saving global_step_{step}: what failed and what is left to resume."""
    last = latest_checkpoint(root)
    reason = exc.strerror or type(exc).__name__
    where = exc.filename or root
    return CheckpointWriteError(
        f"could not write checkpoint global_step_{step} under {root}: {reason} ({where}); "
        f"last usable checkpoint: {last or 'none'}",
        last,
    )


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: itself, or one a rank hit inside torch.distributed.checkpoint
    (whose CheckpointException carries each failed rank's exception)."""
    if isinstance(exc, OSError):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, OSError):
                return inner
    return None


def save_role_state(
    directory: Path,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    *,
    tokenizer: Any = None,
    writer: bool = True,
    contents: Sequence[str] = ALL_CONTENTS,
) -> None:
    """One role's directory: weights (and the optimizer, if in `contents`) through
    torch.distributed.checkpoint (a collective when the model is sharded: every rank calls it); the
    `writer` rank adds the tie map, the LR schedule ("extra") and the Hugging Face metadata."""
    directory = Path(directory)
    aliases = tied_aliases(model)
    save_sharded(directory, model, optimizer if "optimizer" in contents else None, aliases=aliases)
    if writer:
        _write_json(directory / TIED_FILE, aliases)
        if scheduler is not None and "extra" in contents:
            torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
        save_hf_metadata(directory / HF_METADATA_DIR, model, tokenizer)


def load_role_state(
    directory: Path,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    *,
    contents: Sequence[str] = ALL_CONTENTS,
) -> None:
    """Read a role's directory into `model` (any sharding), and the optimizer and LR schedule ("extra")
    when `contents` names them, in place. What is not read starts fresh (AdamW's zero moments, step 0)."""
    directory = Path(directory)
    if not has_sharded_checkpoint(directory):
        raise CheckpointError(f"{str(directory)!r} holds no role weights (no {DCP_METADATA_FILE})")
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        load_sharded(
            directory, model, optimizer if "optimizer" in contents else None, aliases=tied_aliases(model)
        )
    except (Exception, CheckpointException) as exc:  # DCP names the first key or shape that differs
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise CheckpointError(
            f"{str(directory)!r} does not match the model it is loaded into: {detail}"
        ) from exc
    if scheduler is not None and "extra" in contents:
        file = directory / SCHEDULER_FILE
        if not file.is_file():
            raise CheckpointError(f"checkpoint has no {directory.name} scheduler state ({file} missing)")
        scheduler.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))


def load_role_weights(directory: Path) -> dict[str, torch.Tensor]:
    """A role's whole weight tensors on the CPU, tied names restored (for exporting; no process group)."""
    directory = Path(directory)
    tensors = load_full_model_state(directory)
    tied = directory / TIED_FILE
    aliases = json.loads(tied.read_text()) if tied.is_file() else {}
    for alias, stored in aliases.items():
        tensors[alias] = tensors[stored]
    return tensors


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{name: first name} for every parameter or buffer reachable under a second name (tied embeddings)."""
    first: dict[int, str] = {}
    aliases = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def save_hf_metadata(directory: Path, model: nn.Module, tokenizer: Any | None) -> None:
    """Save what rebuilds `model` as a Hugging Face model (into `<role>/huggingface/`): config.json,
    generation_config.json, tokenizer. Models without an HF config (e.g. a bare value head) are skipped.
    Weights are not written here."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _state_record(state: TrainState, step: int, contents: dict[str, list[str]]) -> dict:
    if state.step != step:
        raise ValueError(f"state.step ({state.step}) != step ({step})")
    record = {key: value for key, value in asdict(state).items() if key != "rng_state"}
    return {
        **record,
        "roles": list(contents),
        "contents": contents,
        "format_version": FORMAT_VERSION,
        "saved_at": time.time(),
    }


def _move_into_place(staging: Path, final: Path) -> None:
    """Rename staging -> final; an existing final (same step saved again after a resume) is replaced."""
    if final.exists():
        # rename cannot replace a non-empty directory: set the old one aside first, then drop it
        trash = final.parent / f".trash-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        os.rename(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(staging, final)
    _fsync_dir(final.parent)


def _write_latest(root: Path, step: int) -> None:
    temp = root / f".{LATEST_FILE}.{uuid.uuid4().hex[:8]}"
    with open(temp, "w") as handle:
        handle.write(f"{step}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, root / LATEST_FILE)
    _fsync_dir(root)


def prune_checkpoints(root: Path, keep_last: int | None, *, protect: Path) -> None:
    """Delete the oldest complete checkpoints beyond `keep_last` (never `protect`, the checkpoint just
    written) and leftovers of crashed saves."""
    for leftover in root.glob(".tmp-global_step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(".trash-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(f".{LATEST_FILE}.*"):  # _write_latest's temp file, left by a kill
        leftover.unlink(missing_ok=True)
    if not keep_last or keep_last <= 0:
        return
    complete = [path for _, path in list_checkpoints(root)]
    for path in complete[: max(len(complete) - keep_last, 0)]:
        if path.resolve() == protect.resolve():
            continue
        # rename first: a half-deleted directory must never look like a checkpoint
        trash = root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _write_json(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=2, sort_keys=True))


def _fsync_tree(directory: Path) -> None:
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(directory: Path) -> None:
    # makes a rename / new entry durable; not every platform can open a directory
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- find


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root as (step, dir), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def is_complete(path: Path) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint named by latest_checkpointed_iteration.txt, or None when there is none.

    Falls back to the newest complete directory only if the latest file is missing or names a
    directory that is gone (e.g. deleted by hand).
    """
    root = Path(root)
    latest_file = root / LATEST_FILE
    if latest_file.is_file():
        text = latest_file.read_text().strip()
        if text.isdigit():
            candidate = root / f"global_step_{int(text)}"
            if is_complete(candidate):
                return candidate
    complete = list_checkpoints(root)
    return complete[-1][1] if complete else None


def find_resume_checkpoint(root: Path, resume_mode: ResumeMode, resume_from_path: str | None) -> Path | None:
    """Which checkpoint to resume from (verl's trainer.resume_mode / trainer.resume_from_path).

    auto: the latest complete checkpoint under root, else None (fresh start). disable: None.
    resume_path: `resume_from_path`, a global_step_N dir or an experiment root holding a latest file;
    an error naming the path when it is missing or incomplete.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return latest_checkpoint(root)
    if resume_mode != "resume_path":
        raise ValueError(f"resume_mode must be 'auto', 'disable' or 'resume_path', got {resume_mode!r}")
    if not resume_from_path:
        raise CheckpointError("resume_mode=resume_path needs trainer.resume_from_path")
    path = Path(resume_from_path)
    if not path.exists():
        raise CheckpointError(f"resume_from_path {str(path)!r} does not exist")
    if is_complete(path):
        return path
    if (path / LATEST_FILE).is_file():
        found = latest_checkpoint(path)
        if found is not None:
            return found
    raise CheckpointError(
        f"resume_from_path {str(path)!r} is not a complete checkpoint "
        f"(no {STATE_FILE}; was the save interrupted?)"
    )


# ---------------------------------------------------------------------------------------------- load


def load_train_state(path: Path) -> TrainState:
    """The trainer state alone (no tensors): e.g. to reopen the tracker run before building models."""
    record = _read_state_record(Path(path))
    return TrainState(
        step=int(record["step"]),
        data_cursor=record.get("data_cursor"),
        tracker_run_id=record.get("tracker_run_id"),
        extra=record.get("extra") or {},
    )


def load_checkpoint(
    path: Path,
    *,
    roles: Mapping[str, RoleState],
    contents: Mapping[str, Sequence[str]] | None = None,
) -> TrainState:
    """Load every role's state (and the driver's RNG streams) in place; returns the TrainState.

    `contents`: what to read of each role (default ALL_CONTENTS; hf_model is never read). Asking for a
    part the checkpoint was saved without raises CheckpointError before anything is loaded."""
    path = Path(path)
    state = load_train_state(path)
    record = _read_state_record(path)
    wanted = {}
    for name in roles:
        if not has_sharded_checkpoint(path / name):
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no weights for role {name!r} "
                f"(roles saved: {sorted(record.get('roles', []))})"
            )
        asked = contents.get(name, ALL_CONTENTS) if contents else ALL_CONTENTS
        asked = [c for c in asked if c != "hf_model"]  # written for other tools, never read back
        held = record.get("contents", {}).get(name, ALL_CONTENTS)
        missing, usable = [c for c in asked if c not in held], [c for c in held if c in asked]
        if missing:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds {list(held)} of role {name!r}, without {missing}: resume "
                f"with {_CONFIG_KEY.get(name, name)}.checkpoint.load_contents={usable}"
            )
        wanted[name] = asked
    for name, role in roles.items():
        role.load(str(path / name), wanted[name])
    restore_rng_state(torch.load(path / RNG_FILE, weights_only=True))
    return state


def _read_state_record(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"{str(path)!r} is not a complete checkpoint (no {STATE_FILE})")
    return json.loads((path / STATE_FILE).read_text())


# ----------------------------------------------------------------------------------------------- rng


def capture_rng_state() -> dict:
    """Every generator the loop draws from, in a form torch.load(weights_only=True) accepts."""
    version, mt_state, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "state": list(mt_state), "gauss_next": gauss_next},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda")
    # a checkpoint may be resumed on a different number of GPUs: restore the devices both have
    if cuda_states and torch.cuda.is_available():
        for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
