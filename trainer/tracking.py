"""Experiment tracking and verl's metric names.

`Tracker` fans each step's metrics out to the backends named by `trainer.logger`:
- console: verl's line `step:N - key:value - ...` on stdout, plus a progress bar with ETA on stderr;
- jsonl: RUN_DIR/metrics.jsonl (one JSON object per `log` call) and RUN_DIR/generations.jsonl.
  Always on, whatever the list says: `python -m trainer.report RUN_DIR` draws its curves from it;
- tensorboard (RUN_DIR/tensorboard or $TENSORBOARD_DIR), wandb ($WANDB_MODE=offline works without a
  network), swanlab ($SWANLAB_MODE: online/cloud, local, offline; $SWANLAB_LOG_DIR): optional extras,
  imported only when asked for (`pip install 'rl-jobgroup[loggers]'`).

The tracker's `run_id` is stored in checkpoints (TrainState.tracker_run_id); passing it back on resume
reopens the same W&B / SwanLab run (resume="allow") instead of starting a new one. What the user set
wins: WANDB_RUN_ID / WANDB_RESUME and SWANLAB_RUN_ID / SWANLAB_RESUME name the run and the resume mode
of their backend. RUN_DIR/summary.json (and the W&B run summary) record facts of the run that the
metrics do not, such as the rollout engine that actually generated.

The metric helpers compute verl's names with verl's definitions (verl/trainer/ppo/metric_utils.py):
critic/score/*, critic/rewards/*, critic/advantages/*, critic/returns/*, critic/values/*,
response_length/*, prompt_length/*, timing_s/*, timing_per_token_ms/*, perf/throughput (tokens per
second per GPU), perf/mfu/actor, perf/max_memory_{allocated,reserved}_gb, perf/cpu_memory_used_gb,
training/global_step, training/epoch, training/rollout_probs_diff_*.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import secrets
import string
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "swanlab")
LOGGERS_EXTRA = "pip install 'rl-jobgroup[loggers]'"
METRICS_FILE = "metrics.jsonl"
GENERATIONS_FILE = "generations.jsonl"
SUMMARY_FILE = "summary.json"


def new_run_id() -> str:
    # 21 lowercase alphanumerics: valid as a W&B run id and as a SwanLab experiment id
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(21))


class Tracker:
    """One object the loop logs to; see the module docstring for the backends."""

    def __init__(
        self,
        backends: list[str],
        *,
        project: str,
        experiment: str,
        run_dir: Path,
        config: dict,
        total_steps: int | None,
        run_id: str | None = None,
        start_step: int = 0,
    ) -> None:
        unknown = [name for name in backends if name not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown trainer.logger backend(s) {unknown}; choose from {list(BACKENDS)}")
        self.run_id = run_id or user_run_id(backends) or new_run_id()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.summary = run_summary(config)
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(self.summary, indent=1) + "\n")
        self._warned: set[str] = set()
        names = list(dict.fromkeys(["jsonl", *backends]))
        self._sinks = [
            self._open(name, project, experiment, config, total_steps, start_step) for name in names
        ]

    def _open(
        self, name: str, project: str, experiment: str, config: dict, total_steps: int | None, start_step: int
    ):
        if name == "console":
            return ConsoleSink(total_steps, start_step)
        if name == "jsonl":
            return JsonlSink(self.run_dir)
        if name == "tensorboard":
            return TensorBoardSink(Path(os.environ.get("TENSORBOARD_DIR") or self.run_dir / "tensorboard"))
        if name == "wandb":
            return WandbSink(project, experiment, config, self.run_id, self.run_dir, self.summary)
        return SwanLabSink(
            project,
            experiment,
            config,
            self.run_id,
            Path(os.environ.get("SWANLAB_LOG_DIR") or self.run_dir / "swanlog"),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        scalars = {}
        for key, value in metrics.items():
            scalar = _as_scalar(value)
            if scalar is None:
                if key not in self._warned:
                    self._warned.add(key)
                    warnings.warn(
                        f"metric {key!r} is not a number ({type(value).__name__}); not logged", stacklevel=2
                    )
                continue
            scalars[key] = scalar
        for sink in self._sinks:
            sink.log(scalars, step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        """Validation samples, each {"input", "output", "score"} (extra keys are kept in the JSONL)."""
        for sink in self._sinks:
            sink.log_generations(samples, step)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> Tracker:  # noqa: PYI034 (py3.10 has no typing.Self)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# backend -> (the env naming its run, the env naming its resume mode), as each library documents them
RUN_ENV = {"wandb": ("WANDB_RUN_ID", "WANDB_RESUME"), "swanlab": ("SWANLAB_RUN_ID", "SWANLAB_RESUME")}


def user_run_id(backends: Sequence[str]) -> str | None:
    """The run id the user set for the first external backend asked for (WANDB_RUN_ID, SWANLAB_RUN_ID)."""
    for name in backends:
        if name in RUN_ENV and os.environ.get(RUN_ENV[name][0]):
            return os.environ[RUN_ENV[name][0]]
    return None


def backend_run(name: str, run_id: str) -> tuple[str, str]:
    """(run id, resume mode) for a backend: the user's env when set, else ours and "allow"."""
    id_var, resume_var = RUN_ENV[name]
    return os.environ.get(id_var) or run_id, os.environ.get(resume_var) or "allow"


def run_summary(config: dict) -> dict:
    """Facts of the run the metrics do not carry, from the resolved config (absent keys are skipped)."""
    rollout = config.get("actor_rollout_ref", {}).get("rollout", {})
    facts = {"rollout_engine": rollout.get("engine"), "rollout_engine_requested": rollout.get("name")}
    return {key: value for key, value in facts.items() if value is not None}


def _as_scalar(value: Any) -> int | float | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item") and getattr(value, "size", None) == 1:  # numpy scalars and 1-element arrays
        return value.item()
    return None


def format_console_line(metrics: dict[str, float], step: int) -> str:
    """verl's console line `step:N - key:value - ...` in insertion order, each value by `format_metric`."""
    return " - ".join([f"step:{step}", *(f"{key}:{format_metric(value)}" for key, value in metrics.items())])


def format_metric(value: float) -> str:
    """4 significant digits (a learning rate of 2e-5 is `2e-05`, not verl's `0.000`); whole numbers as
    they are (token counts, steps); large values without an exponent (throughput `12346`)."""
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if abs(value) >= 1e4:
        return f"{value:.0f}"
    return f"{value:.4g}"


def _import_extra(module: str, backend: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"trainer.logger backend {backend!r} needs the package {module!r} "
            f"({exc}); install the optional extra: {LOGGERS_EXTRA}"
        ) from exc


# --------------------------------------------------------------------------------------------- sinks


class ConsoleSink:
    def __init__(self, total_steps: int | None, start_step: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="Training Progress",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=1.0,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        # tqdm.write clears the bar, prints the line on stdout, then redraws the bar below it
        self._bar.write(format_console_line(metrics, step), file=sys.stdout)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def log_generations(self, rows: list[dict], step: int) -> None:
        pass

    def close(self) -> None:
        self._bar.close()


class JsonlSink:
    def __init__(self, run_dir: Path) -> None:
        # append: a resumed run continues the same file (trainer.report keeps the last value per step)
        self._metrics = open(run_dir / METRICS_FILE, "a")  # noqa: SIM115 (open for the run's lifetime)
        self._generations = open(run_dir / GENERATIONS_FILE, "a")  # noqa: SIM115

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._metrics.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._metrics.flush()
        # on disk before the step goes on: the loop logs a step before its checkpoint, so a crash
        # (even of the machine) never leaves a checkpointed step without its row
        os.fsync(self._metrics.fileno())

    def log_generations(self, rows: list[dict], step: int) -> None:
        for row in rows:
            self._generations.write(json.dumps({"step": step, **row}, default=str) + "\n")
        self._generations.flush()

    def close(self) -> None:
        self._metrics.close()
        self._generations.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        _import_extra("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_generations(self, rows: list[dict], step: int) -> None:
        self._writer.add_text("val/generations", _generations_markdown(rows), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(
        self, project: str, experiment: str, config: dict, run_id: str, run_dir: Path, summary: dict
    ) -> None:
        self._wandb = _import_extra("wandb", "wandb")
        # mode comes from $WANDB_MODE (online / offline / disabled), as users of verl expect
        run_id, resume = backend_run("wandb", run_id)
        self._run = self._wandb.init(
            project=project, name=experiment, id=run_id, resume=resume, config=config, dir=str(run_dir)
        )
        # written at close: a summary written before the first log of a resumed offline run loses that
        # session's history
        self._summary = summary

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_generations(self, rows: list[dict], step: int) -> None:
        table = self._wandb.Table(
            columns=["step", "input", "output", "score"],
            data=[[step, row.get("input"), row.get("output"), row.get("score")] for row in rows],
        )
        self._run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        if self._summary:
            self._run.summary.update(self._summary)
        self._run.finish()
        # finish() returns before wandb's service has written the run's last records; teardown waits
        # for it, so the run folder is complete once the tracker is closed (not only at process exit).
        self._wandb.teardown()


class SwanLabSink:
    def __init__(self, project: str, experiment: str, config: dict, run_id: str, log_dir: Path) -> None:
        self._swanlab = _import_extra("swanlab", "swanlab")
        mode = os.environ.get("SWANLAB_MODE")
        api_key = os.environ.get("SWANLAB_API_KEY")
        if api_key and mode not in ("local", "offline", "disabled"):
            self._swanlab.login(api_key=api_key)
        log_dir.mkdir(parents=True, exist_ok=True)
        self._swanlab.init(
            **_swanlab_init_kwargs(self._swanlab.init, project, experiment, config, run_id, log_dir, mode)
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._swanlab.log(metrics, step=step)

    def log_generations(self, rows: list[dict], step: int) -> None:
        texts = [self._swanlab.Text(_generations_markdown([row])) for row in rows]
        self._swanlab.log({"val/generations": texts}, step=step)

    def close(self) -> None:
        self._swanlab.finish()


def _swanlab_init_kwargs(
    init, project: str, experiment: str, config: dict, run_id: str, log_dir: Path, mode: str | None
) -> dict:
    """swanlab.init's argument names changed across versions (logdir -> log_dir, experiment_name -> name)."""
    params = inspect.signature(init).parameters
    kwargs: dict[str, Any] = {"project": project, "config": config}
    kwargs["log_dir" if "log_dir" in params else "logdir"] = str(log_dir)
    kwargs["name" if "name" in params else "experiment_name"] = experiment
    if mode:
        # "cloud" is verl's spelling; newer swanlab calls it "online"
        accepted = str(params["mode"].annotation) if "mode" in params else ""
        kwargs["mode"] = "online" if mode == "cloud" and "online" in accepted else mode
    if "id" in params and "resume" in params:
        run_id, resume = backend_run("swanlab", run_id)
        kwargs.update(id=run_id, resume=_swanlab_resume(resume))
    return kwargs


def _swanlab_resume(value: str) -> str | bool:
    """SwanLab takes must / allow / never, or a boolean; SWANLAB_RESUME=true means must."""
    lowered = value.strip().lower()
    if lowered in ("must", "allow", "never"):
        return lowered
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ValueError(f"SWANLAB_RESUME={value!r}: expected must, allow, never, true or false")


def _generations_markdown(rows: list[dict]) -> str:
    return "\n---\n".join(
        f"### sample {index}\n\n**input:** {row.get('input')}\n\n**output:** {row.get('output')}\n\n"
        f"**score:** {row.get('score')}\n"
        for index, row in enumerate(rows, 1)
    )


# ------------------------------------------------------------------------------------- metric helpers


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def compute_data_metrics(
    *,
    scores: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    response_lengths: torch.Tensor,
    prompt_lengths: torch.Tensor,
    max_response_length: int,
    max_prompt_length: int,
    token_rewards: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    total_response_lengths: torch.Tensor | None = None,
) -> dict[str, float]:
    """verl's batch statistics.

    scores [B]: the reward function's score per sequence. token_rewards [B, T]: rewards after the KL
    penalty (critic/rewards = their sum per sequence); None means no KL in the reward, so rewards =
    scores. advantages / returns / values [B, T]: statistics over tokens where response_mask is 1;
    returns None -> advantages (verl's outcome estimators store returns = advantages).
    response_lengths / prompt_lengths [B]: real (unpadded) token counts; clip_ratio = fraction of
    sequences that hit max_response_length / max_prompt_length (i.e. were truncated).
    total_response_lengths [B]: in multi-turn rollouts, the response with its tool output, for the clip
    ratio (response_lengths then counts the model's own tokens, the loss mask); None: response_lengths.
    """
    scores = torch.as_tensor(scores).float()
    mask = torch.as_tensor(response_mask).bool()
    response_lengths = torch.as_tensor(response_lengths).float()
    prompt_lengths = torch.as_tensor(prompt_lengths).float()
    sequence_rewards = scores if token_rewards is None else torch.as_tensor(token_rewards).float().sum(-1)
    valid_advantages = torch.as_tensor(advantages)[mask]
    valid_returns = valid_advantages if returns is None else torch.as_tensor(returns)[mask]
    metrics = {
        **_stats("critic/score", scores),
        **_stats("critic/rewards", sequence_rewards),
        **_stats("critic/advantages", valid_advantages),
        **_stats("critic/returns", valid_returns),
    }
    if values is not None:
        valid_values = torch.as_tensor(values)[mask].float()
        metrics.update(_stats("critic/values", valid_values))
        returns_float = valid_returns.float()
        metrics["critic/vf_explained_var"] = (
            1.0 - torch.var(returns_float - valid_values) / (torch.var(returns_float) + 1e-5)
        ).item()
    metrics.update(_stats("response_length", response_lengths))
    full_lengths = (
        response_lengths if total_response_lengths is None else torch.as_tensor(total_response_lengths)
    )
    metrics["response_length/clip_ratio"] = (full_lengths >= max_response_length).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_lengths))
    metrics["prompt_length/clip_ratio"] = (prompt_lengths == max_prompt_length).float().mean().item()
    return metrics


# verl normalises generation time by response tokens and the passes over whole sequences by all tokens
_TOKENS_FOR_STAGE = {
    "gen": "response",
    "ref": "all",
    "values": "all",
    "adv": "all",
    "update_critic": "all",
    "update_actor": "all",
}


def rollout_logprob_gap(rollout_logprobs: Tensor, trainer_logprobs: Tensor, response_mask: Tensor) -> dict:
    """How far the engine's logprobs are from the trainer's: [B, R] logprobs of the same tokens from
    each, [B, R] mask -> metrics. The engine samples with its own kernels and dtype (bf16 on GPU); a
    growing gap means the rollout is more off-policy than the algorithm assumes (or an engine bug).
    verl's training/rollout_probs_diff_* (absolute difference of the token *probabilities*) and their
    Pearson correlation; training/rollout_logprob_diff_mean adds the mean absolute logprob difference."""
    mask = response_mask.bool()
    if not bool(mask.any()):
        return {"training/rollout_probs_diff_valid": 0.0}
    engine = rollout_logprobs.detach().float()[mask]
    trainer = trainer_logprobs.detach().float().to(engine.device)[mask.to(engine.device)]
    engine_probs, trainer_probs = engine.exp(), trainer.exp()
    probs_diff = (engine_probs - trainer_probs).abs()
    metrics = {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": probs_diff.max().item(),
        "training/rollout_probs_diff_mean": probs_diff.mean().item(),
        "training/rollout_probs_diff_std": probs_diff.std().item() if probs_diff.numel() > 1 else 0.0,
        "training/rollout_logprob_diff_mean": (engine - trainer).abs().mean().item(),
    }
    if engine_probs.numel() > 1 and engine_probs.std() > 0 and trainer_probs.std() > 0:
        stacked = torch.stack([engine_probs, trainer_probs])
        metrics["training/rollout_actor_probs_pearson_corr"] = torch.corrcoef(stacked)[0, 1].item()
    return metrics


def compute_timing_metrics(
    timings: dict[str, float], *, num_prompt_tokens: int, num_response_tokens: int
) -> dict[str, float]:
    """timing_s/{stage} (seconds) and timing_per_token_ms/{stage} for verl's per-token stages."""
    counts = {"response": num_response_tokens, "all": num_prompt_tokens + num_response_tokens}
    metrics = {f"timing_s/{name}": seconds for name, seconds in timings.items()}
    for name, seconds in timings.items():
        if name in _TOKENS_FOR_STAGE and counts[_TOKENS_FOR_STAGE[name]] > 0:
            metrics[f"timing_per_token_ms/{name}"] = seconds * 1000.0 / counts[_TOKENS_FOR_STAGE[name]]
    return metrics


def compute_throughput_metrics(total_tokens: int, step_time_s: float, n_gpus: int) -> dict[str, float]:
    """perf/throughput = all tokens of the step (prompts + responses) / (step time * GPUs), as verl."""
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_time_s,
        "perf/throughput": total_tokens / (step_time_s * max(n_gpus, 1)),
    }


def training_flops(
    *, num_params: int, seq_lens: Sequence[int], num_layers: int, attention_dim: int, shared_tokens: int = 0
) -> float:
    """FLOPs of one forward + backward pass over these sequences (verl's estimate, dense models).

    6 * N per token: every weight does a multiply-add (2 FLOPs) forward and twice that backward; N
    counts the weights used in matmuls, the LM head included (the embedding lookup does none, so with
    tied embeddings count them once). Attention scores and the weighted sum of values add
    2 * 2 * s^2 * attention_dim per layer forward, times 3 with backward: 12 * layers * dim * s^2 per
    sequence of length s (no causal halving, like verl). attention_dim = num_heads * head_dim.
    shared_tokens: prompt tokens the weights never saw (model.share_prompts runs a group's prompt once);
    their attention is still done, per sample.
    """
    tokens = sum(seq_lens) - shared_tokens
    return 6.0 * num_params * tokens + 12.0 * num_layers * attention_dim * sum(s * s for s in seq_lens)


def mfu(flops: float, time_s: float, *, n_gpus: int, peak_flops_per_gpu: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s per GPU / the GPU's peak; None without a known peak.

    For perf/mfu/actor pass `training_flops` of the actor's update tokens times ppo_epochs and the
    update_actor time.
    """
    if not peak_flops_per_gpu or time_s <= 0:
        return None
    return flops / (time_s * max(n_gpus, 1) * peak_flops_per_gpu)


# dense (no sparsity) bf16 tensor-core peaks in FLOP/s, from the vendors' data sheets; first match wins
_PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
)


def peak_flops_per_gpu(device_name: str) -> float | None:
    """Peak bf16 FLOP/s of the GPU named `device_name` (torch.cuda.get_device_name); None when unknown."""
    for marker, flops in _PEAK_BF16_FLOPS:
        if marker in device_name:
            return flops
    return None


def memory_metrics() -> dict[str, float]:
    """verl's perf/cpu_memory_used_gb: the host's used memory in GiB (psutil's `used`, as verl).

    The GPU peaks are not the driver's: each rank reports its own with its update
    (trainer/parallel/ranks.py `peak_memory`) and the group keeps the largest."""
    import psutil

    return {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / 2**30}


def progress_metrics(step: int, epoch: int) -> dict[str, float]:
    """verl's training/global_step and training/epoch (0-based, the epoch the step's prompts came from)."""
    return {"training/global_step": step, "training/epoch": epoch}


def timed(name: str, fn, *args) -> dict[str, float]:
    """Run fn(*args) and return {"timing_s/<name>": seconds}, e.g. timed("save_checkpoint", save, ...)."""
    timings: dict[str, float] = {}
    with timer(name, timings):
        fn(*args)
    return {f"timing_s/{name}": timings[name]}


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """`with timer("gen", timings): ...` adds the block's wall time to timings[name] (seconds).

    Adds rather than overwrites, so a stage run several times in a step (e.g. DAPO refills) counts in
    full. It does not synchronise CUDA: stages end by bringing results to the CPU, which waits anyway.
    """
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
