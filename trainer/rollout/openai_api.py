"""OpenAI-compatible routes of the rollout server: /v1/models, /v1/completions, /v1/chat/completions.

Shapes follow SGLang 0.5.23's srt/entrypoints/openai/protocol.py (CompletionRequest,
ChatCompletionRequest, CompletionResponse, ChatCompletionResponse, ModelCard, ErrorResponse) and
serving_base.py (errors: 400 {"object": "error", "message", "type": "BadRequestError", "param",
"code"}). Each request becomes a native /generate request (chat: the tokenizer's chat template with the
generation prompt), so the sampling rules and refusals are /generate's. Fields the engine cannot honour
(tools, response_format, logit_bias, penalties, streaming, top logprobs, ...) are refused when set;
unknown fields are ignored, as SGLang's pydantic models ignore them. Logprobs are the sampled tokens'
only (OpenAI's `logprobs: true` / `logprobs: 0`), in OpenAI's layout.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from services.common.app import ready_state
from trainer.rollout.protocol import GenerateRequest
from trainer.rollout.sglang_fields import refused_field

router = APIRouter()

# set to anything but these, each is refused (the engine cannot honour it)
REFUSED_OPENAI: dict[str, Any] = {
    "tools": None,
    "response_format": None,
    "logit_bias": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "regex": None,
    "ebnf": None,
    "json_schema": None,
    "stop_regex": None,
    "lora_path": None,
    "echo": False,
    "suffix": None,
    "best_of": None,
    "stream": False,
    "top_logprobs": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "custom_logit_processor": None,
    "continue_final_message": False,
}


class SamplingFields(BaseModel):
    """What both routes share, with SGLang's OpenAI defaults."""

    model_config = ConfigDict(extra="allow")

    model: str = "default"
    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | list[str] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = None  # OpenAI: the number of top logprobs; 0 = the sampled token's only


class ChatCompletionRequest(SamplingFields):
    messages: list[dict] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    chat_template_kwargs: dict | None = None


def openai_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> Response:
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_card(request)]}


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> Response:
    card = _card(request)
    if model != card["id"]:
        error = {
            "message": f"The model '{model}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return Response(orjson.dumps({"error": error}), status_code=404, media_type="application/json")
    return Response(orjson.dumps(card), media_type="application/json")


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest) -> Response:
    replica = ready_state(request).replica
    if (problem := _refused(body)) is not None:
        return openai_error(problem)
    if body.logprobs not in (None, 0):
        return openai_error("logprobs > 0 (top logprobs) is not supported by this server; use 0")
    prompt = body.prompt
    native = {"input_ids": prompt} if _is_ids(prompt) else {"text": prompt}
    outputs = await _generate(replica, native, body, body.max_tokens, body.logprobs is not None)
    if isinstance(outputs, Response):
        return outputs
    choices = [
        {
            "index": i,
            "text": out["text"],
            "logprobs": _completion_logprobs(out, replica) if body.logprobs is not None else None,
            **_finish(out),
        }
        for i, out in enumerate(outputs)
    ]
    return _answer("cmpl", "text_completion", body.model or _card(request)["id"], choices, outputs)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    replica = ready_state(request).replica
    if (problem := _refused(body)) is not None:
        return openai_error(problem)
    if replica.tokenizer is None or not getattr(replica.tokenizer, "chat_template", None):
        return openai_error("this server's tokenizer has no chat template; use /v1/completions")
    try:
        ids = replica.tokenizer.apply_chat_template(
            body.messages, add_generation_prompt=True, tokenize=True, **(body.chat_template_kwargs or {})
        )
    except Exception as exc:  # noqa: BLE001 - a malformed conversation is the caller's 400
        return openai_error(f"messages cannot be rendered by the chat template: {exc}")
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    outputs = await _generate(replica, {"input_ids": ids}, body, limit, body.logprobs)
    if isinstance(outputs, Response):
        return outputs
    choices = [
        {
            "index": i,
            "message": {
                "role": "assistant",
                "content": out["text"],
                "reasoning_content": None,
                "tool_calls": None,
            },
            "logprobs": _chat_logprobs(out, replica) if body.logprobs else None,
            **_finish(out),
        }
        for i, out in enumerate(outputs)
    ]
    return _answer("chatcmpl", "chat.completion", body.model or _card(request)["id"], choices, outputs)


async def _generate(replica, native: dict, body: SamplingFields, max_tokens, logprobs: bool):
    """Run it as /generate; the outputs, or the OpenAI error response for a refused request."""
    sampling = {
        "max_new_tokens": max_tokens,
        "n": body.n,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "no_stop_trim": body.no_stop_trim,
        "sampling_seed": body.seed,
    }
    request = GenerateRequest(**native, sampling_params=sampling, return_logprob=logprobs, rid=body.rid)
    try:
        return await replica.generate(request)
    except ValueError as exc:
        return openai_error(str(exc))


def _refused(body: BaseModel) -> str | None:
    fields = {**(body.model_extra or {}), **body.model_dump(exclude_unset=True)}
    return refused_field(fields, REFUSED_OPENAI)


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str)


def _finish(output: dict) -> dict:
    reason = output["meta_info"]["finish_reason"] or {}
    kind: Literal["stop", "length", "abort"] = reason.get("type", "abort")
    matched = reason.get("matched") if kind == "stop" else None
    return {"finish_reason": kind, "matched_stop": matched}


def _completion_logprobs(output: dict, replica) -> dict:
    pairs = output["meta_info"].get("output_token_logprobs", [])
    tokens = [replica.tokenizer.decode([tid]) if replica.tokenizer else str(tid) for _, tid, _ in pairs]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "text_offset": offsets,
        "token_logprobs": [lp for lp, _, _ in pairs],
        "tokens": tokens,
        "top_logprobs": [None] * len(pairs),
    }


def _chat_logprobs(output: dict, replica) -> dict:
    content = []
    for lp, tid, _ in output["meta_info"].get("output_token_logprobs", []):
        token = replica.tokenizer.decode([tid])
        content.append({"token": token, "bytes": list(token.encode()), "logprob": lp, "top_logprobs": []})
    return {"content": content}


def _answer(prefix: str, kind: str, model: str, choices: list[dict], outputs: list[dict]) -> Response:
    prompt_tokens = outputs[0]["meta_info"]["prompt_tokens"] if outputs else 0
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    body = {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
    }
    return Response(orjson.dumps(body), media_type="application/json")


def _card(request: Request) -> dict:
    replica = ready_state(request).replica
    config = replica.engine.config
    name = replica.model_path or "default"
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": config.context_length,
    }
