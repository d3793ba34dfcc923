"""Contract tests: our rollout server against SGLang's own request and response definitions.

SGLang cannot be installed here, so each test follows a definition read from SGLang 0.5.23 (the PyPI wheel
sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, sha256 00b3cd5b...9937; the wheel records no
commit). The file each follows is named in its docstring, under sglang/. Every test runs a real uvicorn
server (python -m trainer.rollout.server) on loopback with a tiny random model (testing/tiny.py).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from tests.helpers import free_port, service_process
from tests.trainer.test_rollout_engine import encode, hf_greedy, varied_model
from trainer.rollout.client import HttpReplica, RolloutRequestError, _older
from trainer.rollout.sglang_fields import GENERATE_FIELDS, SAMPLING_FIELDS
from trainer.rollout.weight_group import WeightBroadcaster

CONTEXT = 160
SERVER_ARGS = ("--device", "cpu", "--max-running-requests", "8", "--context-length", str(CONTEXT))

# srt/managers/io_struct.py `GenerateReqInput`: every field, in the dataclass's order
GENERATE_REQ_INPUT = """rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes
mm_content_hashes use_audio_in_video video_config sampling_params watermark return_logprob logprob_start_len
top_logprobs_num token_ids_logprob return_sampling_mask sampling_logprobs_mode return_text_in_logprobs
return_flat_raw_top_logprobs return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs_b64 stream
log_metrics return_hidden_states return_routed_experts routed_experts_start_len return_indexer_topk
modalities session_params lora_path lora_id custom_logit_processor positional_embed_overrides bootstrap_host
bootstrap_port bootstrap_room bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank
disagg_prefill_dp_rank routing_key conversation_id http_worker_ipc background require_reasoning
max_thinking_tokens priority extra_key no_logs custom_labels return_bytes return_entropy
return_prompt_token_ids external_trace_header received_time need_wait_for_mm_inputs num_items_assigned
encoder_urls max_dynamic_patch min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch
images_config mm_processor_kwargs multi_item_delimiter_indices token_indices_to_pool cache_salt
kv_hints""".split()

# srt/sampling/sampling_params.py `SamplingParams` (API fields, with their defaults) plus `choice` from
# api/v1/api_types.py `SamplingParams`; top_k's API spelling of "off" is -1
SAMPLING_DEFAULTS = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stream_interval": None,
    "logit_bias": {},
    "sampling_seed": None,
    "custom_params": None,
    "watermark": None,
    "choice": [],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-contract")
    out = {}
    for name, seed in (("first", 3), ("second", 99)):
        model, tok = varied_model("qwen2", seed=seed)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = (model, str(root / name))
    out["tok"] = tok
    return out


@pytest.fixture(scope="module")
def server(models):
    with service_process("trainer.rollout.server", "--model", models["first"][1], *SERVER_ARGS) as (url, _):
        yield url


def post(url, path, payload=None):
    return httpx.post(url + path, json=payload, timeout=60)


def generate(url, **body):
    response = post(url, "/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


def short(**extra):
    return {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True, **extra}


# ------------------------------------------------------------------------------- /generate: the request


def test_our_field_tables_are_sglangs():
    """managers/io_struct.py GenerateReqInput and sampling/sampling_params.py SamplingParams: the server
    classifies every field SGLang has (honoured, hint, or refused when set), and no other."""
    assert set(GENERATE_REQ_INPUT) == GENERATE_FIELDS
    assert set(SAMPLING_DEFAULTS) == SAMPLING_FIELDS


def test_every_generate_field_unset_and_every_sampling_field_at_its_default_is_accepted(server, models):
    """managers/io_struct.py GenerateReqInput (all None-able), sampling/sampling_params.py defaults."""
    prompt = encode(models["tok"])[0]
    body = {name: None for name in GENERATE_REQ_INPUT}
    body.update(
        input_ids=prompt, sampling_params={**SAMPLING_DEFAULTS, "max_new_tokens": 4, "temperature": 0}
    )
    body.update(stream=False, return_logprob=True, return_text_in_logprobs=False)
    out = generate(server, **body)
    assert out["output_ids"] == hf_greedy(models["first"][0], prompt, 4)
    hints = {
        "session_id": "s1",
        "priority": 3,
        "routing_key": "k",
        "extra_key": "x",
        "custom_labels": {"a": "b"},
    }
    sampling = short(custom_params={"k": 1}, stream_interval=2)
    assert (
        generate(server, input_ids=prompt, sampling_params=sampling, **hints)["output_ids"]
        == out["output_ids"]
    )
    unknown = generate(server, input_ids=prompt, sampling_params=short(), not_an_sglang_field=1)
    assert unknown["output_ids"] == out["output_ids"]  # io_struct.py is a dataclass: unknown keys dropped


@pytest.mark.parametrize(
    "field, value",
    [
        ("image_data", "https://example.com/cat.png"),
        ("lora_path", "adapters/a"),
        ("return_hidden_states", True),
        ("session_params", {"id": "s"}),
        ("input_embeds", [[0.1, 0.2]]),
        ("token_ids_logprob", [1, 2]),
        ("custom_logit_processor", "{}"),
        ("bootstrap_host", "10.0.0.1"),
        ("return_routed_experts", True),
        ("routed_dp_rank", 1),
    ],
)
def test_a_field_the_engine_cannot_honour_is_sglangs_400_naming_it(server, field, value):
    """entrypoints/http_server.py `_create_error_response`: 400 {"error": {"message"}}."""
    response = post(server, "/generate", {"input_ids": [5, 6], field: value})
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "sampling, words",
    [
        ({"min_p": 0.1}, "min_p"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"regex": "a+"}, "regex"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        (
            {"not_a_sampling_key": 1},
            "not_a_sampling_key",
        ),  # api_types.py SamplingParams: unknown keys rejected
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
    ],
)
def test_sampling_params_refusals_name_the_key(server, sampling, words):
    response = post(server, "/generate", {"input_ids": [5, 6], "sampling_params": sampling})
    assert response.status_code == 400 and words in response.json()["error"]["message"]


def test_a_body_that_does_not_parse_gets_sglangs_error_response(server):
    """entrypoints/http_server.py's RequestValidationError handler: 400 with openai/protocol.py's
    ErrorResponse {"object": "error", "message", "type": "Bad Request", "param", "code": 400}."""
    response = post(server, "/generate", {"input_ids": "not ids"})
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"object", "message", "type", "param", "code"}
    assert (body["object"], body["type"], body["code"]) == ("error", "Bad Request", 400)
    assert "input_ids" in body["message"]


# ------------------------------------------------------------------------------- /generate: the answer


def test_max_new_tokens_zero_is_prefill_only_with_input_logprobs(server, models):
    """sampling_params.py (max_new_tokens >= 0), logprob_result_processor.py (input_token_logprobs:
    prompt[start:], the first logprob null), tokenizer_manager.py (the [logprob, id, text] triples)."""
    model, _ = models["first"]
    tok = models["tok"]
    prompt = encode(tok)[2]  # 25 tokens
    out = generate(
        server,
        input_ids=prompt,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=2,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt[2:] and entries[0][0] is None
    assert [e[2] for e in entries] == [tok.decode([t]) for t in prompt[2:]]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert [e[0] for e in entries[1:]] == pytest.approx(expected[2:].tolist(), abs=1e-4)
    default = generate(server, input_ids=prompt, sampling_params=short(), return_logprob=True)
    assert default["meta_info"]["input_token_logprobs"] == []  # scheduler.py: -1 means from the prompt's end


def test_max_new_tokens_null_runs_to_the_context_length(server, models):
    """sampling_params.py: max_new_tokens Optional; null is bounded by the context length only."""
    prompt = encode(models["tok"])[0]
    out = generate(server, input_ids=prompt, sampling_params={"max_new_tokens": None, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == CONTEXT - len(prompt)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": CONTEXT - len(prompt)}


def test_output_token_text_and_ids(server, models):
    """tokenizer_manager.py: output_token_logprobs [logprob, id, text] with return_text_in_logprobs."""
    tok = models["tok"]
    out = generate(
        server,
        text="What is 2 + 3?",
        sampling_params=short(),
        return_logprob=True,
        return_text_in_logprobs=True,
    )
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"]
    assert [e[2] for e in entries] == [tok.decode([t]) for t in out["output_ids"]]
    assert out["meta_info"]["prompt_tokens"] == len(tok.encode("What is 2 + 3?"))


def test_request_ids_as_sglang_normalizes_them(server, models):
    """io_struct.py `_normalize_rid`: a string on a batch becomes rid_i; duplicates are refused;
    tokenizer_manager.py: with n > 1 each sample gets its own id."""
    prompts = encode(models["tok"])[:2]
    batch = generate(server, input_ids=prompts, sampling_params=short(), rid="req")
    assert [o["meta_info"]["id"] for o in batch] == ["req_0", "req_1"]
    single = generate(server, input_ids=prompts[0], sampling_params=short(), rid="one")
    assert single["meta_info"]["id"] == "one"
    sampled = generate(server, input_ids=prompts[0], sampling_params=short(n=3), rid="many")
    assert len({o["meta_info"]["id"] for o in sampled}) == 3
    duplicate = post(server, "/generate", {"input_ids": prompts, "rid": ["a", "a"]})
    assert duplicate.status_code == 400 and "duplicate" in duplicate.json()["error"]["message"]


def test_abort_finish_reason_and_pause(server, models):
    """http_server.py /pause_generation (in_place keeps requests), /abort_request, /continue_generation;
    schedule_batch.py FINISH_ABORT.to_json: {"type", "message", "status_code", "err_type"}."""
    prompt = encode(models["tok"])[0]
    assert post(server, "/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"

    async def run() -> dict:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"input_ids": prompt, "sampling_params": short(max_new_tokens=50), "rid": "held"}
            pending = asyncio.create_task(http.post(server + "/generate", json=body))
            await asyncio.sleep(0.5)
            assert not pending.done()  # paused: queued, not run
            assert (await http.post(server + "/abort_request", json={"rid": "held"})).status_code == 200
            return (await pending).json()

    try:
        aborted = asyncio.run(run())
    finally:
        assert post(server, "/continue_generation", {}).json()["status"] == "ok"
    reason = aborted["meta_info"]["finish_reason"]
    assert set(reason) == {"type", "message", "status_code", "err_type"} and reason["type"] == "abort"
    assert generate(server, input_ids=prompt, sampling_params=short())["output_ids"]  # runs again


# ------------------------------------------------------------------------------- the other routes


def test_server_info_load_and_model_routes(server, models):
    """http_server.py /server_info (server args + internal_states + version), /get_load (legacy shape),
    v1_loads.py /v1/loads, /model_info, /v1/models (openai/protocol.py ModelCard, ModelList)."""
    info = httpx.get(server + "/get_server_info").json()
    assert (info["tp_size"], info["dp_size"], info["version"]) == (1, 1, "0.5.23")
    assert info["max_total_num_tokens"] == 8 * CONTEXT and isinstance(info["internal_states"], list)
    load = httpx.get(server + "/get_load").json()
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}
    loads = httpx.get(server + "/v1/loads").json()
    assert {"timestamp", "version", "loads"} <= set(loads) and loads["loads"][0]["dp_rank"] == 0
    models_list = httpx.get(server + "/v1/models").json()
    card = models_list["data"][0]
    assert models_list["object"] == "list" and card["object"] == "model" and card["max_model_len"] == CONTEXT
    assert httpx.get(server + "/v1/models/" + card["id"]).json()["id"] == card["id"]
    assert httpx.get(server + "/v1/models/nope").json()["error"]["code"] == "model_not_found"


def test_weight_version_routes(server):
    """http_server.py /update_weight_version ({"success", "message", "new_version"}); /get_weight_version
    ({"weight_version"}) as older releases and slime's engine read it."""
    answer = post(server, "/update_weight_version", {"new_version": "step-7"}).json()
    assert answer == {"success": True, "message": "Weight version updated to step-7", "new_version": "step-7"}
    assert httpx.get(server + "/get_weight_version").json() == {"weight_version": "step-7"}
    assert httpx.get(server + "/model_info").json()["weight_version"] == "step-7"
    assert post(server, "/update_weight_version", {}).status_code == 400


def test_openai_chat_and_completions(server, models):
    """openai/protocol.py ChatCompletionResponse / CompletionResponse; serving_base.py errors."""
    tok = models["tok"]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    chat = post(
        server, "/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0}
    ).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    native = generate(server, input_ids=ids, sampling_params={"max_new_tokens": 5, "temperature": 0})
    assert chat["choices"][0]["message"]["content"] == native["text"]
    assert chat["usage"]["prompt_tokens"] == len(ids) and chat["choices"][0]["finish_reason"] == "length"
    completion = post(server, "/v1/completions", {"prompt": "2 + 3 =", "max_tokens": 3, "logprobs": 0}).json()
    assert (
        completion["object"] == "text_completion" and len(completion["choices"][0]["logprobs"]["tokens"]) == 3
    )
    refused = post(server, "/v1/chat/completions", {"messages": messages, "tools": [{"type": "function"}]})
    assert (
        refused.status_code == 400
        and refused.json()["object"] == "error"
        and "tools" in refused.json()["message"]
    )


# ------------------------------------------------------------------------------- client flows


def test_slime_and_verl_style_client_flows(server, models):
    """slime (backends/sglang_utils/sglang_engine.py): poll /health_generate, GET /flush_cache, generate
    with custom_params, pause -> abort_all -> update weights (versioned) -> continue, read
    /get_weight_version. verl's HTTP adapter: generate with input_ids and return_logprob, abort_all,
    release / resume memory by tag, flush_cache, read the weight version from /model_info."""
    first, _ = models["first"]
    second, second_dir = models["second"]
    prompt = encode(models["tok"])[2]
    deadline = time.monotonic() + 30
    while httpx.get(server + "/health_generate", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert httpx.get(server + "/flush_cache").status_code == 200
    slime_params = short(
        top_p=0.9, custom_params={"max_top_p": 0.9}, no_stop_trim=True, spaces_between_special_tokens=False
    )
    assert generate(server, input_ids=prompt, sampling_params=slime_params, return_logprob=True)["output_ids"]
    assert post(server, "/pause_generation", {}).status_code == 200
    assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
    update = post(
        server,
        "/update_weights_from_disk",
        {"model_path": second_dir, "weight_version": "2", "flush_cache": False},
    )
    assert update.json() == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }
    assert post(server, "/continue_generation", {}).status_code == 200
    assert httpx.get(server + "/get_weight_version").json()["weight_version"] == "2"
    # verl
    out = generate(
        server, input_ids=prompt, sampling_params=short(max_new_tokens=6), return_logprob=True, rid="v-1"
    )
    assert out["output_ids"] == hf_greedy(second, prompt, 6) and out["meta_info"]["weight_version"] == "2"
    assert post(server, "/abort_request", {"rid": "", "abort_all": True}).status_code == 200
    assert post(server, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert post(server, "/flush_cache").status_code == 200
    assert httpx.get(server + "/model_info").json()["weight_version"] == "2"
    failed = post(server, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
    assert failed.status_code == 400 and failed.json()["success"] is False
    restore = post(
        server, "/update_weights_from_disk", {"model_path": models["first"][1], "weight_version": "1"}
    )
    assert restore.json()["success"] is True
    assert generate(server, input_ids=prompt, sampling_params=short(max_new_tokens=6))[
        "output_ids"
    ] == hf_greedy(first, prompt, 6)


def test_distributed_weight_update_over_gloo(server, models):
    """model_runner_components/weight_updater.py: /init_weights_update_group joins rank_offset + tp_rank
    to the trainer's group (rank 0), /update_weights_from_distributed receives one broadcast per tensor."""
    first, _ = models["first"]
    second, _ = models["second"]
    prompt = encode(models["tok"])[3]

    async def run() -> None:
        replica = HttpReplica(server)
        sender = WeightBroadcaster(
            [replica], master_address="127.0.0.1", master_port=free_port(), backend="gloo"
        )
        try:
            await sender.connect()
            await sender.send(second.state_dict(), weight_version="dist-1")
            assert await replica.get_weight_version() == "dist-1"
            ids = (await replica.generate({"input_ids": prompt, "sampling_params": short(max_new_tokens=6)}))[
                0
            ]
            assert ids["output_ids"] == hf_greedy(second, prompt, 6) != hf_greedy(first, prompt, 6)
            await sender.send(first.state_dict(), weight_version="dist-2")
        finally:
            sender.close()
            await replica._checked("/destroy_weights_update_group", {"group_name": "weight_update_group"})
            await replica.close()

    asyncio.run(run())
    assert generate(server, input_ids=prompt, sampling_params=short(max_new_tokens=6))[
        "output_ids"
    ] == hf_greedy(first, prompt, 6)


def test_seeded_samples_of_a_prompt_differ_and_repeat(server, models):
    """A GRPO group under seeded sampling: the manager gives each sample its own sampling_seed."""
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.manager import http_manager

    tok = models["tok"]
    manager = http_manager([server], pad_id=tok.pad_token_id)
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=5)
        group = [r.response_ids for r in manager.generate(encode(tok)[:1], sampling)]
        assert len({tuple(ids) for ids in group}) > 1
        assert [r.response_ids for r in manager.generate(encode(tok)[:1], sampling)] == group
    finally:
        manager.close()


def test_seed_version_gate():
    """sampling_seed arrived in SGLang 0.5.3 (sgl-project/sglang#10678)."""
    assert _older("0.5.2", (0, 5, 3)) and _older("0.4.10.post2", (0, 5, 3))
    assert not _older("0.5.3", (0, 5, 3)) and not _older("0.5.23", (0, 5, 3)) and not _older("dev", (0, 5, 3))

    async def run() -> None:
        replica = HttpReplica("http://127.0.0.1:9")  # never reached: the version is already known
        replica._version = "0.5.2"
        try:
            with pytest.raises(RolloutRequestError, match="0.5.2 has no sampling_params.sampling_seed"):
                await replica.generate({"input_ids": [1], "sampling_params": {"sampling_seed": 3}})
        finally:
            await replica.close()

    asyncio.run(run())
