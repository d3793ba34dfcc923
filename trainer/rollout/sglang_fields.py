"""Every request field SGLang knows, and what the built-in server does with each.

Read from SGLang 0.5.23 (the PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, sha256
00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937; the wheel names no commit):
- srt/managers/io_struct.py `GenerateReqInput`: the /generate body (a dataclass FastAPI parses, so
  unknown top-level keys are dropped; api/v1/api_types.py `GenerateRequest`, the JSON contract /generate
  checks first, says "unknown keys ignored" too).
- srt/sampling/sampling_params.py `SamplingParams` and api/v1/api_types.py `SamplingParams` ("unknown
  keys rejected"): the sampling_params keys.

Three kinds of field, so that no field SGLang knows ever gets a 422 here:
- honoured: the server does what SGLang does (protocol.py);
- hints: routing, caching, tracing and logging metadata that cannot change a single engine's answer;
  accepted and left unused, as SGLang's single-replica server leaves most of them;
- refused unless unset (null, false, 0, "", [] or {}): features the engine lacks (images, LoRA,
  grammars, penalties, ...). Set, they get a 400 naming the field rather than a silently different answer.
"""

from __future__ import annotations

from typing import Any

# top_logprobs_num: 0 only, stream: false only (see protocol.py)
GENERATE_HONOURED = frozenset(
    """rid text input_ids sampling_params return_logprob logprob_start_len top_logprobs_num
    return_text_in_logprobs return_prompt_token_ids stream""".split()
)
# session_id "does not alter or reconstruct the prompt" (io_struct.py); routed_experts_start_len is read
# only with return_routed_experts; one engine is DP rank 0 (a non-zero routed_dp_rank or
# data_parallel_rank is refused in protocol.py)
GENERATE_HINTS = frozenset(
    """session_id log_metrics routed_experts_start_len routed_dp_rank data_parallel_rank
    disagg_prefill_dp_rank routing_key conversation_id http_worker_ipc priority extra_key cache_salt no_logs
    custom_labels external_trace_header received_time kv_hints""".split()
)
GENERATE_REFUSED = frozenset(
    """input_embeds image_data video_data audio_data mm_hashes mm_content_hashes use_audio_in_video
    video_config watermark token_ids_logprob return_sampling_mask sampling_logprobs_mode
    return_flat_raw_top_logprobs return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs_b64
    return_hidden_states return_routed_experts return_indexer_topk modalities session_params lora_path
    lora_id custom_logit_processor positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room
    bootstrap_pair_key decode_tp_size background require_reasoning max_thinking_tokens return_bytes
    return_entropy need_wait_for_mm_inputs num_items_assigned encoder_urls max_dynamic_patch
    min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch images_config mm_processor_kwargs
    multi_item_delimiter_indices token_indices_to_pool""".split()
)
GENERATE_FIELDS = GENERATE_HONOURED | GENERATE_HINTS | GENERATE_REFUSED

SAMPLING_HONOURED = frozenset(
    """max_new_tokens stop stop_token_ids temperature top_p top_k n ignore_eos skip_special_tokens
    spaces_between_special_tokens no_stop_trim sampling_seed""".split()
)
# stream_interval paces streaming, which is refused; custom_params feed a custom_logit_processor, refused
SAMPLING_HINTS = frozenset({"stream_interval", "custom_params"})
# each with the value that means "off" (SGLang's default)
SAMPLING_REFUSED: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "beam_width": 1,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "watermark": None,
    "choice": None,
}
SAMPLING_FIELDS = SAMPLING_HONOURED | SAMPLING_HINTS | frozenset(SAMPLING_REFUSED)


POSITION_LISTS = frozenset({"multi_item_delimiter_indices", "token_indices_to_pool"})


def is_unset(value: Any) -> bool:
    """null, false, 0, "", or a list / dict of nothing but those (SGLang normalizes [None] * n the same)."""
    if value is None or value is False or value == 0 or value == "":
        return True
    if isinstance(value, list):
        return all(is_unset(v) for v in value)
    if isinstance(value, dict):
        return all(is_unset(v) for v in value.values())
    return False


def refused_field(body: dict, refused) -> str | None:
    """The first refused field that is set, as a message naming it; None when there is none."""
    for name in refused:
        if name not in body:
            continue
        value = body[name]
        neutral = refused.get(name) if isinstance(refused, dict) else None
        # a list of token positions is set whatever its numbers: [0] names the first token
        positions = name in POSITION_LISTS and isinstance(value, list) and any(v is not None for v in value)
        if (is_unset(value) or value == neutral) and not positions:
            continue
        return f"{name} is not supported by this server (the built-in engine); leave it unset" + (
            f" or {neutral!r}" if neutral not in (None, 0, 0.0) else ""
        )
    return None
