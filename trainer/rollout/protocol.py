"""The rollout wire protocol: SGLang's native HTTP API as the trainer and SGLang-speaking tools use it.

Every rollout replica speaks it: an SGLang server (`python -m sglang.launch_server`) or the built-in
engine's server (`python -m trainer.rollout.server`), so the trainer's client cannot tell them apart.
torch-free: the client side imports it without the engine.

Checked field by field against SGLang 0.5.23 (the PyPI wheel; sglang_fields.py gives its sha256), under
sglang/srt/:
- entrypoints/http_server.py: the routes; /generate answers a list for a batch and 400
  {"error": {"message"}} for a request it refuses (`_create_error_response`); a body that does not
  parse is a 400 with the OpenAI-style ErrorResponse {"object": "error", "message", "type", "param",
  "code"}; the weight-update routes answer {"success", "message"}.
- managers/io_struct.py: GenerateReqInput (every field: sglang_fields.py), UpdateWeightFromDiskReqInput,
  UpdateWeightsFromTensorReqInput, InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput,
  UpdateWeightVersionReqInput, PauseGenerationReqInput, Release/ResumeMemoryOccupationReqInput.
  A string rid on a batch becomes rid_0, rid_1, ... (`_normalize_rid`); with n > 1 every sample gets a
  fresh id (tokenizer_manager.py regenerates them) and per-prompt lists of logprob options are refused.
- sampling/sampling_params.py: the sampling_params keys and defaults (max_new_tokens 128, null: up to
  the context length, 0: prefill only; top_k -1 is off; temperature 0 is greedy).
- managers/tokenizer_manager.py: the meta_info keys; output_token_logprobs / input_token_logprobs are
  lists of [logprob, token_id, text or null] (text with return_text_in_logprobs); a batch with n > 1
  answers prompt-major (prompt i's n samples together).
- managers/scheduler_components/logprob_result_processor.py: input_token_logprobs cover
  prompt[logprob_start_len:], the first entry's logprob null; logprob_start_len -1 means none
  (scheduler.py sets it to the prompt length).
- managers/schedule_batch.py: finish_reason is {"type": "stop", "matched": id or string},
  {"type": "length", "length": n} or {"type": "abort", "message", "status_code", "err_type"}.
- layers/sampler.py: logprobs are log_softmax(logits / T) before top-k / top-p (unless the env
  SGLANG_RETURN_ORIGINAL_LOGPROB is set); greedy reports the untempered ones.

`output_ids` include the stop token, as SGLang returns them (`text` trims a stop string unless
no_stop_trim). What the built-in engine cannot do (images, LoRA, grammars, penalties, top logprobs,
streaming, ...) is refused with a 400 naming the field, never silently ignored (sglang_fields.py).
/update_weights_from_tensor: SGLang's payload is a pickled CUDA-IPC handle per TP rank, which only a
process on the same GPU can open and which we will not unpickle from HTTP; the built-in server takes
load_format "safetensors" instead: each entry the base64 of a safetensors file. The other ways SGLang
takes weights work as SGLang's do: /update_weights_from_disk and /update_weights_from_distributed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer.rollout.base import Rollout, SamplingParams
from trainer.rollout.sglang_fields import (
    GENERATE_REFUSED,
    SAMPLING_HINTS,
    SAMPLING_REFUSED,
    refused_field,
)

SAFETENSORS_FORMAT = "safetensors"
SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose HTTP API this protocol follows


class WireSamplingParams(BaseModel):
    """`sampling_params` of /generate (SGLang's names and defaults; unknown keys refused, as SGLang's
    JSON contract refuses them)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(128, ge=0)  # null: up to the context length; 0: prefill only
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
    sampling_seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)

    @model_validator(mode="before")
    @classmethod
    def _defaults_and_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # SGLang: null means the default, except max_new_tokens, where null means the context length
        data = {k: v for k, v in data.items() if v is not None or k == "max_new_tokens"}
        if (problem := refused_field(data, SAMPLING_REFUSED)) is not None:
            raise ValueError(problem)
        return {k: v for k, v in data.items() if k not in SAMPLING_REFUSED and k not in SAMPLING_HINTS}

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return value


class GenerateRequest(BaseModel):
    """POST /generate. Types of the honoured fields are checked here; every other field SGLang knows is
    kept (extra) and judged by generate_items; a key SGLang does not know is ignored, as SGLang does."""

    model_config = ConfigDict(extra="allow")

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict | list[dict] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool | None = False
    return_prompt_token_ids: bool | None = False
    rid: str | list[str] | None = None
    stream: bool | None = False

    @property
    def is_single(self) -> bool:
        if self.input_ids is not None:
            return not self.input_ids or isinstance(self.input_ids[0], int)
        return isinstance(self.text, str)


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a /generate request, ready for an engine."""

    prompt: list[int]
    sampling: SamplingParams | None  # None: prefill only (max_new_tokens 0)
    wire: WireSamplingParams
    return_logprob: bool
    logprob_start: int | None  # first prompt position with an input logprob; None: none asked
    rid: str  # the engine's request id (what /abort_request names)
    output_ids: tuple[str, ...]  # meta_info.id of each of its n samples


def generate_items(
    request: GenerateRequest,
    *,
    context_length: int,
    encode: Callable[[str], list[int]] | None = None,
) -> list[GenerateItem]:
    """Split a request into per-prompt items; ValueError naming the problem (the server's 400).
    encode: the tokenizer, for `text` prompts; context_length: what max_new_tokens null fills up to."""
    check_supported(request)
    prompts = _prompts(request, encode)
    count = len(prompts)
    wires = [
        _sampling(p, i)
        for i, p in enumerate(_per_prompt(request.sampling_params or {}, count, "sampling_params"))
    ]
    n = wires[0].n
    if any(w.n != n for w in wires):
        raise ValueError("every sampling_params must have the same n")
    lists_ok = n == 1  # SGLang: "Cannot use list return_logprob with parallel_sample_num > 1"
    logprob = _per_prompt(request.return_logprob, count, "return_logprob", lists_ok)
    starts = _per_prompt(request.logprob_start_len, count, "logprob_start_len", lists_ok)
    for top in _per_prompt(request.top_logprobs_num, count, "top_logprobs_num", lists_ok):
        if top not in (None, 0):
            raise ValueError("top_logprobs_num is not supported by this server (leave it 0)")
    rids = _rids(request, count)
    items = []
    for index, (prompt, wire, want, start, rid) in enumerate(zip(prompts, wires, logprob, starts, rids)):
        start = _logprob_start(bool(want), start, len(prompt), index)
        sampling = engine_sampling(wire, context_length - len(prompt))
        ids = (rid,) if n == 1 else tuple(uuid.uuid4().hex for _ in range(n))
        items.append(GenerateItem(prompt, sampling, wire, bool(want), start, rid, ids))
    return items


def check_supported(request: GenerateRequest) -> None:
    """400 for a field SGLang knows that the engine cannot honour, set to something other than unset."""
    extra = request.model_extra or {}
    if (problem := refused_field(extra, GENERATE_REFUSED)) is not None:
        raise ValueError(problem)
    for rank in ("routed_dp_rank", "data_parallel_rank"):
        if extra.get(rank) not in (None, 0):
            raise ValueError(f"{rank} {extra[rank]!r}: this server is one engine, data-parallel rank 0")
    if request.stream:
        raise ValueError("stream=true is not supported by this server")


def _prompts(request: GenerateRequest, encode) -> list[list[int]]:
    if (request.input_ids is None) == (request.text is None):
        raise ValueError("send exactly one of input_ids and text")
    if request.input_ids is not None:
        prompts = [request.input_ids] if request.is_single else list(request.input_ids)
    else:
        if encode is None:
            raise ValueError("text prompts need the server's tokenizer; send input_ids")
        texts = [request.text] if isinstance(request.text, str) else list(request.text)
        prompts = [encode(t) for t in texts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("input_ids must hold at least one non-empty prompt")
    return prompts


def _sampling(params: Any, index: int) -> WireSamplingParams:
    try:
        return WireSamplingParams.model_validate(params)
    except ValidationError as exc:
        where = "sampling_params" if index == 0 else f"sampling_params[{index}]"
        problems = "; ".join(
            f"{'.'.join(str(p) for p in (where, *e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors(include_url=False)
        )
        raise ValueError(problems) from None


def _per_prompt(value, count: int, name: str, lists_ok: bool = True) -> list:
    if not isinstance(value, list):
        return [value] * count
    if not lists_ok:
        raise ValueError(f"a list of {name} cannot be used with n > 1 (SGLang refuses it too)")
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
    return value


def _rids(request: GenerateRequest, count: int) -> list[str]:
    """SGLang's normalization: one id for one prompt; a string on a batch becomes rid_0, rid_1, ..."""
    rid = request.rid
    if request.is_single and not isinstance(rid, list):
        return [rid or uuid.uuid4().hex]
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)]
    if len(rid) != count:
        raise ValueError(f"rid has {len(rid)} entries for {count} prompts")
    if len(set(rid)) != len(rid):
        raise ValueError(f"duplicate request ids in rid: {sorted({r for r in rid if rid.count(r) > 1})}")
    return list(rid)


def _logprob_start(want: bool, start: int | None, length: int, index: int) -> int | None:
    """The first prompt position that gets an input logprob (length: none of them), or None."""
    if not want:
        return None
    if start is None or start == -1:
        return length
    if not 0 <= start <= length:
        raise ValueError(
            f"logprob_start_len {start} is outside prompt {index}'s {length} tokens (use -1 or 0..{length})"
        )
    return start


def engine_sampling(wire: WireSamplingParams, room: int) -> SamplingParams | None:
    """The engine's SamplingParams; None for a prefill-only request (max_new_tokens 0).
    room: the tokens left in the context after the prompt (what max_new_tokens null asks for)."""
    max_new = room if wire.max_new_tokens is None else wire.max_new_tokens
    if max_new == 0 or (wire.max_new_tokens is None and room <= 0):
        return None
    return SamplingParams(
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k,
        max_new_tokens=max_new,
        stop=(wire.stop,) if isinstance(wire.stop, str) else tuple(wire.stop or ()),
        stop_token_ids=tuple(wire.stop_token_ids or ()),
        n=wire.n,
        seed=wire.sampling_seed,
        ignore_eos=wire.ignore_eos,
    )


def wire_sampling(sampling: SamplingParams) -> dict:
    """SamplingParams -> an SGLang-API server's sampling_params JSON."""
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
    if sampling.seed is not None:  # SGLang honours it only under --enable-deterministic-inference
        params["sampling_seed"] = sampling.seed
    return params


def finish_reason(kind: Literal["stop", "length", "abort"], matched: int | str | None) -> dict:
    """SGLang's finish_reason object (schedule_batch.py's FINISH_* to_json)."""
    if kind == "stop":
        return {"type": "stop", "matched": matched}
    if kind == "length":
        return {"type": "length", "length": matched}
    return {"type": "abort", "message": str(matched or "Aborted"), "status_code": None, "err_type": None}


def logprob_entries(
    logprobs: Sequence[float | None], token_ids: Sequence[int], texts: Sequence[str] | None = None
) -> list[list]:
    """SGLang's [logprob, token_id, text or null] triples."""
    texts = texts if texts is not None else [None] * len(token_ids)
    return [[lp, tid, text] for lp, tid, text in zip(logprobs, token_ids, texts)]


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
    output_texts: list[str] | None = None,
    input_logprobs: list[list] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict:
    """One /generate result, as SGLang's tokenizer manager builds it (non-streaming). logprobs: the
    output tokens' (None: return_logprob was off); input_logprobs: logprob_entries of the prompt."""
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
        meta["output_token_logprobs"] = logprob_entries(logprobs, output_ids, output_texts)
        meta["output_token_logprobs_length"] = len(output_ids)
        meta["input_token_logprobs"] = input_logprobs or []
    item = {"text": text, "output_ids": output_ids, "meta_info": meta}
    if prompt_token_ids is not None:
        item["prompt_token_ids"] = prompt_token_ids
    return item


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


# The request models below ignore keys they do not name (pydantic's default), as SGLang's msgspec structs
# drop them: SGLang's scheduling knobs (is_async, keep_pause, ...), torch_empty_cache, selector.


class UpdateWeightsFromDiskRequest(BaseModel):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightsFromTensorRequest(BaseModel):
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class MemoryOccupationRequest(BaseModel):
    """/release_memory_occupation and /resume_memory_occupation (io_struct.py Release/Resume
    MemoryOccupationReqInput: BaseReq's rid and http_worker_ipc, then tags; other keys ignored, as
    SGLang's msgspec structs drop them). constants.py GPU_MEMORY_ALL_TYPES names three tags; the
    built-in engine frees its CUDA graphs with the KV cache, so "cuda_graph" alone changes nothing."""

    rid: str | None = None
    http_worker_ipc: str | None = None
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class InitWeightsUpdateGroupRequest(BaseModel):
    """/init_weights_update_group (io_struct.py InitWeightsUpdateGroupReqInput)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)  # rank 0 is the trainer
    world_size: int = Field(ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = "nccl"


class DestroyWeightsUpdateGroupRequest(BaseModel):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedRequest(BaseModel):
    """/update_weights_from_distributed: the metadata of the tensors rank 0 broadcasts next, in order."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["direct"] | None = None  # flattened_bucket is not implemented here

    @model_validator(mode="after")
    def _aligned(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


class UpdateWeightVersionRequest(BaseModel):
    new_version: str
    abort_all_requests: bool = True


class AbortRequest(BaseModel):
    """/abort_request (io_struct.py AbortReq): one rid, or abort_all."""

    rid: str | None = ""
    abort_all: bool = False


class PauseGenerationRequest(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"
