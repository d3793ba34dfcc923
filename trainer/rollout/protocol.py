"""The rollout wire protocol: the subset of SGLang's native HTTP API that the trainer uses.

Every rollout replica speaks it: an SGLang server (`python -m sglang.launch_server`) or the built-in
engine's server (`python -m trainer.rollout.server`), so the trainer's client cannot tell them apart.
torch-free: the client side imports it without the engine.

Checked field by field against SGLang 0.5.23 (the PyPI wheel, read 2026-11), under sglang/srt/:
- entrypoints/http_server.py: the routes; /generate answers a list for a batch and 400
  {"error": {"message"}} for bad input; the weight-update routes answer {"success", "message"}.
- managers/io_struct.py: GenerateReqInput, UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput,
  Release/ResumeMemoryOccupationReqInput (tags: "weights", "kv_cache").
- sampling/sampling_params.py: the sampling_params keys and defaults (max_new_tokens 128; top_k -1 is
  off; temperature 0 is greedy).
- managers/tokenizer_manager.py: the meta_info keys; output_token_logprobs is a list of
  [logprob, token_id, text or null]; a batch with n > 1 answers prompt-major (prompt i's n together).
- managers/schedule_batch.py: finish_reason is {"type": "stop", "matched": id or string},
  {"type": "length", "length": n} or {"type": "abort", "message": ...}.
- layers/sampler.py: logprobs are log_softmax(logits / T) before top-k / top-p (unless the env
  SGLANG_RETURN_ORIGINAL_LOGPROB is set); greedy reports the untempered ones.

`output_ids` include the stop token, as SGLang returns them (`text` trims a stop string unless
no_stop_trim). The built-in server refuses with 400, rather than silently ignoring, what it does not
implement: text prompts, streaming, prompt / top logprobs, penalties, min_p, min_new_tokens, grammars.
/update_weights_from_tensor: SGLang's payload is a pickled CUDA-IPC handle per TP rank, which only a
process on the same GPU can open and which we will not unpickle from HTTP; the built-in server takes
load_format "safetensors" instead: each entry the base64 of a safetensors file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer.rollout.base import Rollout, SamplingParams

UNSUPPORTED_SAMPLING = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
    "beam_width": None,
}
SAFETENSORS_FORMAT = "safetensors"


class WireSamplingParams(BaseModel):
    """`sampling_params` of /generate (SGLang's names and defaults)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults_and_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {key: value for key, value in data.items() if value is not None}  # SGLang: null = default
        for key, neutral in UNSUPPORTED_SAMPLING.items():
            if key in data and data[key] != neutral:
                raise ValueError(f"{key} is not supported by this server (leave it at {neutral!r})")
            data.pop(key, None)
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return value

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class GenerateRequest(BaseModel):
    """POST /generate: token ids in, one sampling_params for all prompts (or one per prompt)."""

    model_config = ConfigDict(extra="forbid")

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: WireSamplingParams | list[WireSamplingParams] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _supported(self) -> GenerateRequest:
        if self.text is not None:
            raise ValueError("send token ids in input_ids; this server does not tokenize text")
        if self.input_ids is None:
            raise ValueError("input_ids is required")
        if self.stream:
            raise ValueError("stream=true is not supported by this server")
        for name in ("logprob_start_len", "top_logprobs_num"):
            values = getattr(self, name)
            values = values if isinstance(values, list) else [values]
            if any(v not in (None, -1, 0) for v in values):
                raise ValueError(f"{name} is not supported (only output-token logprobs are returned)")
        return self

    @property
    def is_single(self) -> bool:
        return bool(self.input_ids) and isinstance(self.input_ids[0], int)


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a /generate request, ready for an engine."""

    prompt: list[int]
    sampling: SamplingParams
    wire: WireSamplingParams
    return_logprob: bool
    rid: str | None


def generate_items(request: GenerateRequest) -> list[GenerateItem]:
    """Split a request into per-prompt items; ValueError naming the problem (the server's 400)."""
    prompts = [request.input_ids] if request.is_single else list(request.input_ids)
    if not prompts or any(not p for p in prompts):
        raise ValueError("input_ids must hold at least one non-empty prompt")
    count = len(prompts)
    wires = _per_prompt(request.sampling_params or WireSamplingParams(), count, "sampling_params")
    if len({w.n for w in wires}) > 1:
        raise ValueError("every sampling_params must have the same n")
    logprob = _per_prompt(request.return_logprob, count, "return_logprob")
    rids = _per_prompt(request.rid, count, "rid")
    return [
        GenerateItem(prompt, engine_sampling(wire), wire, bool(want), rid)
        for prompt, wire, want, rid in zip(prompts, wires, logprob, rids)
    ]


def _per_prompt(value, count: int, name: str) -> list:
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
    return value


def engine_sampling(wire: WireSamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k,
        max_new_tokens=wire.max_new_tokens,
        stop=wire.stops(),
        stop_token_ids=tuple(wire.stop_token_ids or ()),
        n=wire.n,
        seed=wire.sampling_seed,
        ignore_eos=wire.ignore_eos,
    )


def wire_sampling(sampling: SamplingParams, seed: int | None = None) -> dict:
    """SamplingParams -> an SGLang-API server's sampling_params JSON (`seed` overrides sampling.seed)."""
    params = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
        "n": sampling.n,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    seed = sampling.seed if seed is None else seed
    if seed is not None:  # SGLang honours it only under --enable-deterministic-inference, else ignores it
        params["sampling_seed"] = seed
    return params


def finish_reason(kind: Literal["stop", "length", "abort"], matched: int | str | None) -> dict:
    """SGLang's finish_reason object."""
    if kind == "stop":
        return {"type": "stop", "matched": matched}
    if kind == "length":
        return {"type": "length", "length": matched}
    return {"type": "abort", "message": str(matched or "aborted")}


def output_item(
    *,
    rid: str,
    text: str,
    output_ids: list[int],
    logprobs: list[float] | None,
    finish: dict,
    prompt_tokens: int,
    weight_version: str,
    e2e_latency: float,
) -> dict:
    """One /generate result, as SGLang's tokenizer manager builds it (non-streaming)."""
    meta = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "e2e_latency": e2e_latency,
    }
    if logprobs is not None:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(logprobs, output_ids)]
        meta["output_token_logprobs_length"] = len(output_ids)
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def rollouts_from_outputs(prompt: list[int], prompt_index: int, outputs: list[dict]) -> list[Rollout]:
    """SGLang-format results of one prompt (n samples, return_logprob on) -> Rollouts."""
    rollouts = []
    for item in outputs:
        meta = item["meta_info"]
        tokens = list(item["output_ids"])
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise ValueError("the replica returned no output_token_logprobs (send return_logprob=true)")
        if [int(p[1]) for p in pairs] != tokens:
            raise ValueError("output_token_logprobs do not match output_ids")
        reason = (meta.get("finish_reason") or {}).get("type", "abort")
        rollouts.append(
            Rollout(
                prompt_ids=list(prompt),
                response_ids=tokens,
                logprobs=[float(p[0]) for p in pairs],
                loss_mask=[1] * len(tokens),
                finish_reason=reason if reason in ("stop", "length") else "abort",
                prompt_index=prompt_index,
            )
        )
    return rollouts


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's scheduling knobs (is_async, keep_pause, ...)

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightsFromTensorRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class MemoryOccupationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tags: list[Literal["weights", "kv_cache"]] | None = None


class UpdateWeightsResponse(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = 0
