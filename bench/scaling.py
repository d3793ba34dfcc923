"""Weak scaling of the distributed trainer: the same GRPO step per GPU on 1, 2, 4, ... GPUs of one host,
for one or more model shapes, and A/B runs of the speed options, printed as one table.

    python bench/scaling.py --gpus 1,2,4 --model-size 0.5b,1.5b          # the issue-16 matrix
    python bench/scaling.py --gpus 1 --compile on,off --fused-head on,off  # A/B of the actor's speed-ups
    python bench/scaling.py --gpus 1,2,4 --tools search                    # Search-R1 tool calls on
    python bench/scaling.py --gpus 1,2 --small --device cpu                 # CPU smoke run (gloo, tiny model)

Each case is one `python -m trainer.main_ppo` run on a randomly initialised model of Qwen2.5-0.5B's (or
1.5B's) shape, Qwen tokenizer, GSM8K train prompts, W x 64 prompts x n=8 responses of 256 tokens per step (a
random model rarely stops early), a coin per response for reward (bench/coin_reward.py: real advantages, so
the update is timed on real gradients), GRPO with a KL loss against a reference model, one optimizer step per
batch, rewards in-process: Ray ranks with FSDP2 (bf16 compute, fp32 master weights), packed micro-batches, and
on every GPU the rollout engine next to the policy (rollout.name=builtin by default).
It reports the median over the steps after the first (the first is warm-up: compilation, CUDA graphs,
Triton kernels; the median, as a later step can still compile once: a shorter last chunk of the
log-prob head did, and the mean of two steps then read as a 1.7x slower update):

    timing_s/* (gen, old_log_prob, ref, update_actor, update_weights, step), perf/throughput (tokens/s
    per GPU), perf/mfu/actor, perf/max_memory_allocated_gb (largest rank), and the weak-scaling
    efficiency: throughput per GPU against the same shape and variant on 1 GPU (1.0 is perfect).

Variants: --compile, --fused-head, --micro-batch, --engine, --gathers, --tools, --reshard and
--layers-per-unit take comma lists; their first values make the main variant, which runs at every GPU
count; every other combination runs at --ab-gpus only (default: the smallest count). Extra `key=value`
arguments go to every run.

--tools search (default off): Search-R1-style multi-turn GRPO through the agent loop instead, the search
tool calling a real retrieval-server (`python -m services.retrieval_server`, a BM25 index over the corpus
of testing/search.py, started here on a loopback port and stopped at the end). The prompts are that
module's short search rows (data_source nq, scored in-process by exact match); --response-length is the
whole multi-turn budget; up to 4 model turns; each search result cut to its first 7 tokens. A random
model never writes `<search>`, so each shape's model is first taught the format (a few AdamW steps on
two targets: the search turn after the prompt, an answer after the result, as the loop lays out their
tokens) into model-<shape>-search, and greedy generation on prompts it was not taught must then start
with the search turn, or the bench stops there. The table adds tool_calls/mean, num_turns/mean,
tool/errors, timing_s/tool_calls/search and its share of timing_s/step; `--tools off,search` is an A/B.

Made to fit one device call: --steps 4 (one warm-up step, three measured), the models are written once,
one Ray cluster serves every case (started here; each run joins it through RAY_ADDRESS), --parallel
runs cases side by side when their GPUs fit (a 1-GPU and a 2-GPU case on 4 GPUs), and --budget-s stops
starting cases that cannot finish in time (a running one is stopped at the budget). Each case's output
goes to <results>/<case>.log; only the table (reprinted after every case) and failures reach stdout.
On the offline GPU machines: `bash bench/gpu_prepare.sh` here first; its header has the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from testing.search import QWEN_SEARCH_RESULT_TOKENS  # noqa: E402 - after the path insert

REPORTED = (
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "perf/throughput",
    "perf/mfu/actor",
    "perf/max_memory_allocated_gb",
    "response_length/mean",
    "tool_calls/mean",  # the tools-on metrics (trainer/agent/loop.py)
    "num_turns/mean",
    "tool/errors",
    "timing_s/tool_calls/search",
    "gpu/sm_clock_mhz",  # the case's GPUs while it ran (GpuSampler): a hot, power-capped card clocks lower
    "gpu/power_w",
    "gpu/temperature_c_max",
)
SWITCHES = {"on": "true", "off": "false"}
SEARCH_RESULT_TOKENS = QWEN_SEARCH_RESULT_TOKENS  # of each search result: what the models are taught
TOOL_SECONDS = "timing_s/tool_calls/search"
# The retrieval-server (BM25) off the GPUs: where JAX is installed, bm25s selects its top-k with JAX, which
# takes 75% of a GPU's memory the moment it starts (the runs then ran out of memory in their update).
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
TOOLS = {  # --tools value -> config overrides (services.retrieval_url is added per run)
    "off": [],
    "search": [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.format=search_r1",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",  # Search-R1's
        f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={SEARCH_RESULT_TOKENS}",
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
    ],
}
OPTIONS = {  # --option value -> config overrides
    "compile": lambda on: [
        f"actor_rollout_ref.actor.use_torch_compile={SWITCHES.get(on, on)}",
        f"actor_rollout_ref.ref.use_torch_compile={SWITCHES.get(on, on)}",
    ],
    "fused_head": lambda on: [f"actor_rollout_ref.model.use_fused_kernels={SWITCHES.get(on, on)}"],
    "micro_batch": lambda size: [
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={2 * int(size)}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={2 * int(size)}",
    ],
    "engine": lambda name: [f"actor_rollout_ref.rollout.name={name}"],
    "gathers": lambda dtype: [  # fsdp_config.mixed_precision.param_dtype of the policy and the reference
        f"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={dtype}",
        f"actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype={dtype}",
    ],
    "tools": lambda name: TOOLS[name],
    # fsdp_config.reshard_after_forward of the policy: off keeps each layer's gathered parameters from its
    # forward to its backward (one all-gather a layer a micro-batch instead of two; ~1 GB held at 0.5B)
    "reshard": lambda on: [
        f"actor_rollout_ref.actor.fsdp_config.reshard_after_forward={SWITCHES.get(on, on)}"
    ],
    # fsdp_config.layers_per_unit of the policy and the reference: k decoder layers a unit (one all-gather
    # and one reduce-scatter for k; at 4 GPUs 2 took ~0.07 s off the update in one run, 2026-11-29)
    "layers_per_unit": lambda k: [
        f"actor_rollout_ref.actor.fsdp_config.layers_per_unit={k}",
        f"actor_rollout_ref.ref.fsdp_config.layers_per_unit={k}",
    ],
}


@dataclass(frozen=True)
class Teaching:
    """teach_search_format's settings for one model shape: full-batch AdamW on `rows` prompts."""

    steps: int
    lr: float
    rows: int


# Per shape. The tiny one (hidden 64) learns both targets in 60 steps at 5e-3 (loss 0.06, 54 s on 2 CPU
# cores: the Qwen vocabulary's head is most of it). Rates like that are for 64-wide models; the 0.5B and
# 1.5B shapes get AdamW at 1e-4 / 5e-5 (each weight moves ~1e-2 over the steps, against an init of 0.02):
# on an H100, loss 0.002 in 47 s (0.5B) and 0.0000 in 84 s (1.5B), the check included, both passed.
TEACHING = {
    "tiny": Teaching(steps=60, lr=5e-3, rows=4),
    "0.5b": Teaching(steps=100, lr=1e-4, rows=16),
    "1.5b": Teaching(steps=100, lr=5e-5, rows=16),
}


@dataclass(frozen=True)
class Variant:
    name: str  # "" for the main variant
    overrides: tuple[str, ...]
    tools: str = "off"  # a TOOLS key


@dataclass
class Case:
    size: str
    world: int
    variant: Variant
    status: str = "waiting"  # waiting, running, done, failed, timed out, skipped
    result: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    wall_s: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.size} x{self.world}" + (f" {self.variant.name}" if self.variant.name else "")

    @property
    def slug(self) -> str:
        return self.label.replace(" ", "_").replace("=", "-").replace(",", "+")


@dataclass(frozen=True)
class Inputs:
    """What the cases run on: a model folder per (shape, tools), a prompts file per tools value, and the
    retrieval-server's URL when a case searches."""

    models: dict[tuple[str, str], Path]
    prompts: dict[str, Path]
    retrieval_url: str | None = None


def prepare(work: Path, gsm8k: Path, sizes: list[str]) -> tuple[dict[tuple[str, str], Path], Path]:
    """Random models of each shape (bf16 safetensors: half the bytes to write and read) and the GSM8K
    prompts."""
    import torch

    from services.data_server.export import write_verl_parquet
    from services.data_server.sources import gsm8k_row, read_records
    from testing.tiny import make_tiny_model, qwen25_05b_config, qwen25_15b_config

    shapes = {"0.5b": qwen25_05b_config, "1.5b": qwen25_15b_config, "tiny": lambda: None}
    models = {}
    for size in sizes:
        model = work / f"model-{size}"
        if not (model / "config.json").exists():
            config = shapes[size]()  # tiny: hidden 64, 2 layers
            make_tiny_model(model, config=config, tokenizer="qwen", hidden=64, layers=2, dtype=torch.bfloat16)
        models[size, "off"] = model
    prompts = work / "data" / "train.parquet"
    if not prompts.exists():
        rows = read_records(gsm8k / "train.jsonl")
        write_verl_parquet(
            [gsm8k_row(r["question"], r["answer"], "train", i) for i, r in enumerate(rows)], prompts
        )
    return models, prompts


# ------------------------------------------------------------------------------ --tools search


def prepare_search(
    work: Path, sizes: list[str], rows: int, teaching: dict[str, Teaching], device: str
) -> tuple[dict[tuple[str, str], Path], Path, Path]:
    """-> (each shape's taught model, the search prompts file, the BM25 index folder)."""
    from testing.search import write_corpus, write_search_rows

    prompts = write_search_rows(work / "search", train=range(rows), test=range(4)) / "train.jsonl"
    index = work / "index-bm25"
    if not (index / "manifest.json").exists():
        corpus = write_corpus(work / "corpus.jsonl")
        subprocess.run(
            [sys.executable, "-m", "services.retrieval_server", "build", "--corpus", str(corpus),
             "--out", str(index), "--index", "bm25", "--no-progress", "--overwrite"],
            cwd=ROOT, env={**os.environ, **CPU_ONLY}, check=True,
        )  # fmt: skip
    models = {(size, "search"): taught_model(work, size, teaching[size], device) for size in sizes}
    return models, prompts, index


def taught_model(work: Path, size: str, teaching: Teaching, device: str) -> Path:
    """model-<size> copied to model-<size>-search and taught the search format there, in a spawned
    process (the GPU memory it takes is free again for the runs); kept for later runs with the same
    teaching. Exits, showing what the model wrote, when it does not open with the search turn."""
    from testing.search import SEARCH_TURN

    taught = work / f"model-{size}-search"
    settings = json.dumps(asdict(teaching))
    if (taught / "taught.json").exists() and (taught / "taught.json").read_text() == settings:
        return taught
    shutil.rmtree(taught, ignore_errors=True)
    shutil.copytree(work / f"model-{size}", taught)
    started = time.monotonic()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        loss, turns = child.submit(teach, taught, teaching, device).result()
    print(
        f"[bench] {taught.name}: taught in {time.monotonic() - started:.0f} s ({teaching.steps} steps, "
        f"lr {teaching.lr:g}, {teaching.rows} prompts), last loss {loss:.4f}",
        flush=True,
    )
    for first, after_result in turns:
        print(f"    | first turn {first!r}; after the result {after_result!r}", flush=True)
    if not all(first.startswith(SEARCH_TURN) for first, _ in turns):
        sys.exit(
            f"error: {taught.name} does not open with {SEARCH_TURN!r} on prompts it was not taught (its "
            "greedy turns above): it would never call the tool. Teach it longer or at another rate "
            "(--teach-steps, --teach-lr)."
        )
    if not all(after.startswith("<answer>") for _, after in turns):
        print(f"[bench] warning: {taught.name} does not always answer after the search result", flush=True)
    (taught / "taught.json").write_text(settings)
    return taught


def teach(model: Path, teaching: Teaching, device: str) -> tuple[float, list[tuple[str, str]]]:
    """teach_search_format on rows 0..rows-1, then the greedy turns on four prompts after those ->
    (the last loss, [(the first turn, the turn after the search result)]), the turns' contexts laid
    out as the agent loop lays them out."""
    import torch
    from transformers import AutoModelForCausalLM

    from testing.search import SEARCH_TURN, search_information, short_search_row, teach_search_format
    from trainer.model import load_tokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [short_search_row(i) for i in range(teaching.rows)]
    loss = teach_search_format(
        model, rows, steps=teaching.steps, lr=teaching.lr, device=device, tool_tokens=SEARCH_RESULT_TOKENS
    )
    tokenizer = load_tokenizer(str(model))
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    information = search_information(tokenizer, SEARCH_RESULT_TOKENS)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def greedy(ids: list[int]) -> str:
        inputs = torch.tensor([ids], device=device)
        out = policy.generate(
            inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=12, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        return tokenizer.decode(out[0, len(ids) :])

    turns = []
    for row in map(short_search_row, range(teaching.rows, teaching.rows + 4)):
        prompt = encode(
            tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        )
        turns.append((greedy(prompt), greedy(prompt + encode(SEARCH_TURN) + information)))
    return loss, turns


def variants(args) -> list[Variant]:
    """The cross product of the option lists; the first combination is the main variant."""
    chosen = {name: getattr(args, name).split(",") for name in OPTIONS if getattr(args, name)}
    combos = list(itertools.product(*chosen.values()))
    out = []
    for combo in combos:
        values = dict(zip(chosen, combo))
        overrides = tuple(key for name, value in values.items() for key in OPTIONS[name](value))
        label = ",".join(f"{name.replace('_', '-')}={value}" for name, value in values.items())
        tools = values.get("tools", "off")
        # the main variant is named too when there are others (the table says what they are compared
        # with) or when it calls tools (a table of tools-on runs says so)
        out.append(Variant(label if len(combos) > 1 or tools != "off" else "", overrides, tools))
    return out


def plan(args) -> list[Case]:
    """In running order: per shape, the GPU counts ascending, each followed by its A/B variants (so that,
    with --parallel, a 4-GPU host runs the 1-GPU, 2-GPU and a 1-GPU variant case side by side)."""
    sizes, worlds = args.model_size.split(","), sorted(int(w) for w in args.gpus.split(","))
    every = variants(args) or [Variant("", ())]
    ab_worlds = [int(w) for w in args.ab_gpus.split(",")] if args.ab_gpus else [worlds[0]]
    cases = []
    for size in sizes:
        for world in sorted(set(worlds) | set(ab_worlds)):
            cases += [Case(size, world, every[0])] if world in worlds else []
            cases += [Case(size, world, v) for v in every[1:]] if world in ab_worlds else []
    return cases


def py_spy() -> str:
    """py-spy's binary: on PATH, beside this Python, or in the bin/ of a folder on sys.path (where
    `pip install --target` puts it)."""
    places = [Path(sys.executable).parent, *(Path(d) / "bin" for d in sys.path if d)]
    found = shutil.which("py-spy") or next(
        (str(p / "py-spy") for p in places if (p / "py-spy").exists()), None
    )
    if found is None:
        sys.exit("error: --sample-driver needs py-spy (pip install py-spy; bench/gpu_prepare.sh carries it)")
    return found


def run_command(args, case: Case, inputs: Inputs, run_dir: Path, extra: list[str]) -> list[str]:
    prompts = args.prompts_per_gpu * case.world
    tools = case.variant.tools
    search = [f"services.retrieval_url={inputs.retrieval_url}"] if tools == "search" else []
    # a random model scores 0 on GSM8K: a coin per response gives real advantages (bench/coin_reward.py)
    coin = [] if tools == "search" else [f"custom_reward_function.path={ROOT / 'bench' / 'coin_reward.py'}"]
    return [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={inputs.prompts[tools]}",
        f"data.val_files={inputs.prompts[tools]}",
        f"data.train_batch_size={prompts}",
        "data.max_prompt_length=512",
        f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.model.path={inputs.models[case.size, tools]}",
        "actor_rollout_ref.model.use_remove_padding=true",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",  # one optimizer step: on-policy
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch_default}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch_default * 2}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.micro_batch_default * 2}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.name=builtin",
        "reward_model.mode=local",
        f"trainer.n_gpus_per_node={case.world}",
        f"trainer.device={args.device}",
        "trainer.use_ray=true",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        f"trainer.log_dir={run_dir}",
        f"trainer.default_local_dir={run_dir / 'ckpt'}",
        "trainer.resume_mode=disable",
        *case.variant.overrides,
        *search,
        *coin,
        *extra,
    ]


def summarise(run_dir: Path) -> dict[str, float]:
    """The median of each reported metric over the logged steps after the first (warm-up); with one step,
    that step's. Peak memory is the largest. Every other timing_s/* key goes into results.json too (not
    the table), so a step's time not in the reported phases (reward, advantages, the driver) can be read.
    With the search tool, tool_share_of_step: the median of each step's search seconds (wall time with
    a search in flight) over its step time."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "timing_s/step" in m]
    measured = steps[1:] or steps
    timings = sorted({key for m in measured for key in m if key.startswith("timing_s/")})
    out = {}
    for key in [*REPORTED, *(k for k in timings if k not in REPORTED)]:
        values = [m[key] for m in measured if key in m]
        if values:
            out[key] = max(values) if key.startswith("perf/max_memory") else statistics.median(values)
    shares = [m[TOOL_SECONDS] / m["timing_s/step"] for m in measured if TOOL_SECONDS in m]
    if shares:
        out["tool_share_of_step"] = statistics.median(shares)
    return out


# ------------------------------------------------------------------------------ one Ray cluster for all


def start_ray(args) -> str | None:
    """A local Ray cluster that lives as long as this process; every run joins it (RAY_ADDRESS)."""
    if args.fresh_ray:
        return None
    import ray

    num_cpus = (
        max(max(int(w) for w in args.gpus.split(",")), os.cpu_count() or 1) if args.device == "cpu" else None
    )
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, object_store_memory=512 * 2**20)
    return ray.get_runtime_context().gcs_address


def gpus_idle(timeout_s: float = 60.0) -> None:
    """Wait until the GPUs hold no memory of a finished run's ranks (their processes end asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return  # no nvidia-smi (CPU runs)
        if all(int(line) < 1024 for line in out.split()):
            return
        time.sleep(1.0)


class GpuSampler:
    """nvidia-smi's SM clock, power draw and temperature of every GPU once a second while a case runs.

    Same code, same card, and an update ran 10-20% slower on real than on zero gradients, and slowed step
    by step in a second run straight after a first (BENCHMARKS.md, 2026-11-29): the clocks say which run
    met a hotter card. Nothing is sampled where nvidia-smi is missing (CPU runs)."""

    QUERY = "--query-gpu=clocks.sm,power.draw,temperature.gpu"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.process: subprocess.Popen | None = None
        with open(path, "w") as out, contextlib.suppress(OSError):  # the child writes to its own copy
            self.process = subprocess.Popen(
                ["nvidia-smi", self.QUERY, "--format=csv,noheader,nounits", "-l", "1"],
                stdout=out,
                stderr=subprocess.DEVNULL,
            )

    def stop(self) -> dict[str, float]:
        """The medians of the clock and power and the hottest reading, over the later half of the samples
        (the first half is mostly loading and compiling)."""
        if self.process is None:
            return {}
        self.process.terminate()
        self.process.wait()
        rows = []
        for line in self.path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append([float(field) for field in line.split(",")])
        rows = [row for row in rows[len(rows) // 2 :] if len(row) == 3]
        if not rows:
            return {}
        clock, power, temperature = zip(*rows)
        return {
            "gpu/sm_clock_mhz": statistics.median(clock),
            "gpu/power_w": statistics.median(power),
            "gpu/temperature_c_max": max(temperature),
        }


# ------------------------------------------------------------------------------ running the cases


class Runner:
    """Starts cases in order (the next one also while others run, when --parallel and its GPUs are free)
    and stops them at the budget."""

    def __init__(self, args, inputs: Inputs, extra, ray_address: str | None, on_finish) -> None:
        """on_finish(): called after every case ends (the table is reprinted)."""
        self.args, self.inputs, self.extra = args, inputs, extra
        self.on_finish = on_finish
        self.deadline = time.monotonic() + args.budget_s if args.budget_s else None
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if ray_address:
            self.env["RAY_ADDRESS"] = ray_address
        self.total_gpus = max(int(w) for w in args.gpus.split(","))
        self.running: dict[int, tuple[Case, subprocess.Popen, object]] = {}
        self.samplers: dict[int, GpuSampler] = {}

    def remaining(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def run(self, cases: list[Case]) -> None:
        waiting = list(cases)
        try:
            while waiting or self.running:
                started = self._start_what_fits(waiting)
                if not started:
                    self._wait_one()
        finally:  # an interrupt or a failure here: no run goes on holding GPUs
            for _, process, _ in self.running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            for sampler in self.samplers.values():
                sampler.stop()

    def _start_what_fits(self, waiting: list[Case]) -> bool:
        busy = sum(case.world for case, _, _ in self.running.values())
        started = False
        for case in list(waiting):
            if self.remaining() < self.args.min_case_s:
                case.status = "skipped"
                waiting.remove(case)
                print(
                    f"[bench] {case.label}: skipped, {max(self.remaining(), 0):.0f} s of budget left",
                    flush=True,
                )
                continue
            fits = busy + case.world <= self.total_gpus if self.args.parallel else not self.running
            if not fits:
                break  # in order: a case that does not fit yet holds back the ones after it
            if not self.running:
                gpus_idle()
            waiting.remove(case)
            self._start(case)
            busy += case.world
            started = True
            if not self.args.parallel:
                break
        return started

    def _start(self, case: Case) -> None:
        run_dir = self.args.out / case.slug
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        log = open(self.args.results / f"{case.slug}.log", "w")  # noqa: SIM115 - closed when it ends
        command = run_command(self.args, case, self.inputs, run_dir, self.extra)
        if self.args.sample_driver:  # py-spy samples the run's driver, idle too, in time order, unpaused
            spy = [py_spy(), "record", "--idle", "--nonblocking", "--rate", "100", "-f", "speedscope"]
            command = [*spy, "-o", str(run_dir / "driver.json"), "--", *command]
        process = subprocess.Popen(
            command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        case.status, case.started = "running", time.monotonic()
        self.running[process.pid] = (case, process, log)
        if not self.args.parallel:  # cases side by side share the GPUs' samples: none are taken then
            self.samplers[process.pid] = GpuSampler(run_dir / "gpu.csv")
        print(f"[bench] {case.label}: started ({len(self.running)} running)", flush=True)

    def _wait_one(self) -> None:
        while True:
            for pid, (case, process, _) in list(self.running.items()):
                if process.poll() is not None:
                    self._finish(pid)
                    return
                if self.remaining() <= 0:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    case.status = "timed out"
                    self._finish(pid)
                    return
            time.sleep(0.5)

    def _finish(self, pid: int) -> None:
        case, process, log = self.running.pop(pid)
        log.close()
        sampler = self.samplers.pop(pid, None)
        telemetry = sampler.stop() if sampler else {}
        case.wall_s = time.monotonic() - case.started
        run_dir = self.args.out / case.slug
        if (run_dir / "driver.json").exists():  # compressed beside the logs (the raw samples run to ~20 MB)
            with (
                open(run_dir / "driver.json", "rb") as raw,
                gzip.open(self.args.results / f"{case.slug}.driver.json.gz", "wb") as out,
            ):
                shutil.copyfileobj(raw, out)
        if process.returncode == 0 and (run_dir / "metrics.jsonl").exists():
            case.result, case.status = summarise(run_dir) | telemetry, "done"
        elif case.status != "timed out":
            case.status = f"failed (exit {process.returncode})"
        print(f"[bench] {case.label}: {case.status} after {case.wall_s:.0f} s", flush=True)
        if case.status != "done":
            tail = (self.args.results / f"{case.slug}.log").read_text(errors="replace").splitlines()[-25:]
            print("\n".join(f"    | {line}" for line in tail), flush=True)
        self.on_finish()


# ------------------------------------------------------------------------------ the table


def efficiency(case: Case, cases: list[Case]) -> float | None:
    """Throughput per GPU against the same shape and variant on the fewest GPUs measured."""
    peers = [c for c in cases if c.size == case.size and c.variant == case.variant and c.result]
    base = min(peers, key=lambda c: c.world, default=None)
    if base is None or "perf/throughput" not in case.result or not base.result.get("perf/throughput"):
        return None
    return case.result["perf/throughput"] / base.result["perf/throughput"]


def print_table(args, cases: list[Case]) -> None:
    shown = [c for c in cases if c.status not in ("waiting", "running")]
    if not shown:
        return
    width = max(14, *(len(c.label) + 2 for c in shown))
    print(
        f"\nGRPO step per GPU: {args.prompts_per_gpu} prompts x n={args.n}, responses <= "
        f"{args.response_length} tokens; the median of steps 2-{args.steps} (the first is warm-up)"
    )
    print(f"  {'metric':<30}" + "".join(f"{c.label:>{width}}" for c in shown))
    for key in REPORTED:
        if any(key in c.result for c in shown):
            print(f"  {key:<30}" + "".join(_cell(c.result.get(key), width) for c in shown))
    if any("tool_share_of_step" in c.result for c in shown):
        print(
            f"  {'tool share of step':<30}"
            + "".join(_cell(c.result.get("tool_share_of_step"), width) for c in shown)
        )
    print(f"  {'weak-scaling efficiency':<30}" + "".join(_cell(efficiency(c, shown), width) for c in shown))
    print(f"  {'run wall time (s)':<30}" + "".join(_cell(c.wall_s, width, ".0f") for c in shown))
    print(f"  {'status':<30}" + "".join(f"{c.status[: width - 1]:>{width}}" for c in shown), flush=True)


def _cell(value, width: int, spec: str = ".3f") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", default="1,2", help="comma-separated GPU counts, in one host")
    parser.add_argument("--model-size", default="0.5b", help="comma-separated: 0.5b, 1.5b, tiny")
    parser.add_argument("--gsm8k", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_scaling", help="models, run dirs")
    parser.add_argument("--results", type=Path, default=None, help="logs and results.json (default: --out)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-gpu", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=256)
    # 64: at 32 the update is launch-bound at this size (MFU 13.6% on an H200; 25.9% at 64 on an H100)
    parser.add_argument("--micro-batch-default", type=int, default=128, help="sequences per update forward")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--compile", default=None, help="A/B: on,off (default: the config's, on)")
    parser.add_argument("--fused-head", default=None, help="A/B: on,off (model.use_fused_kernels)")
    parser.add_argument("--micro-batch", default=None, help="A/B: e.g. 32,64 (sequences per GPU)")
    parser.add_argument("--engine", default=None, help="A/B: builtin,hf (rollout.name)")
    parser.add_argument("--gathers", default=None, help="A/B: bf16,fp32 (fsdp mixed_precision.param_dtype)")
    parser.add_argument("--tools", default=None, help="A/B: off,search (Search-R1 search tool calls)")
    parser.add_argument("--reshard", default=None, help="A/B: on,off (policy reshard_after_forward)")
    parser.add_argument("--layers-per-unit", default=None, help="A/B: e.g. 1,2 (fsdp_config.layers_per_unit)")
    parser.add_argument("--teach-steps", type=int, default=None, help="--tools search: default per shape")
    parser.add_argument("--teach-lr", type=float, default=None, help="--tools search: default per shape")
    parser.add_argument(
        "--ab-gpus", default=None, help="GPU counts of the non-main variants (default: fewest)"
    )
    parser.add_argument("--parallel", action="store_true", help="run cases side by side when their GPUs fit")
    parser.add_argument(
        "--sample-driver",
        action="store_true",
        help="py-spy samples each run's driver: <results>/<case>.driver.json.gz (trace_summary.py)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="stop starting (and stop) cases after this"
    )
    parser.add_argument("--min-case-s", type=float, default=60.0, help="do not start a case with less left")
    parser.add_argument("--fresh-ray", action="store_true", help="each run starts its own Ray cluster")
    parser.add_argument("--small", action="store_true", help="--model-size tiny (CPU smoke run)")
    parser.add_argument("--device", default="auto")
    args, extra = parser.parse_known_args()
    args.results = args.results or args.out
    args.model_size = "tiny" if args.small else args.model_size
    unknown = set((args.tools or "off").split(",")) - set(TOOLS)
    if unknown:
        parser.error(f"--tools: {', '.join(sorted(unknown))}; choose from {', '.join(TOOLS)}")
    args.results.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # the finally blocks run
    started = time.monotonic()
    cases = plan(args)
    models, prompts = prepare(args.out, args.gsm8k, sorted({c.size for c in cases}))
    inputs = Inputs(models, {"off": prompts})
    searching = sorted({c.size for c in cases if c.variant.tools == "search"})
    index = None
    if searching:
        teaching = {
            size: Teaching(
                args.teach_steps or TEACHING[size].steps,
                args.teach_lr or TEACHING[size].lr,
                TEACHING[size].rows,
            )
            for size in searching
        }
        rows = args.prompts_per_gpu * max(c.world for c in cases) * args.steps
        taught, search_prompts, index = prepare_search(args.out, searching, rows, teaching, args.device)
        inputs = Inputs({**models, **taught}, {"off": prompts, "search": search_prompts})
    print(
        f"[bench] {len(cases)} case(s); models and data ready after {time.monotonic() - started:.0f} s",
        flush=True,
    )

    def report() -> None:
        print_table(args, cases)
        records = [{"case": c.label, "status": c.status, "wall_s": c.wall_s, **c.result} for c in cases]
        (args.results / "results.json").write_text(json.dumps(records, indent=1))

    with contextlib.ExitStack() as services:
        if index is not None:  # stopped when the cases are over, or on an error or an interrupt
            from tests.helpers import service_process

            serve = ("serve", "--index", str(index), "--log-level", "warning")
            url, _ = services.enter_context(
                service_process("services.retrieval_server", *serve, env=CPU_ONLY, timeout_s=300)
            )
            inputs = Inputs(inputs.models, inputs.prompts, url)
            print(f"[bench] retrieval-server at {url} (BM25 over {index})", flush=True)
        Runner(args, inputs, extra, start_ray(args), report).run(cases)
    print(f"[bench] all cases over after {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
