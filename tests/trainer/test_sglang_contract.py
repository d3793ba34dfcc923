"""Contract tests: our rollout server against SGLang's own request and response definitions.

SGLang cannot be installed here, so each test follows a definition read from SGLang 0.5.23 (the PyPI wheel
sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, sha256 00b3cd5b...9937; the wheel records no
commit). The file each follows is named in its docstring, under sglang/. Every test runs a real server on
loopback with a tiny random model (testing/tiny.py), in two variants of the `server` fixture:
- ours: python -m trainer.rollout.server (uvicorn, CPU);
- sglang: real SGLang, started by trainer.rollout.launcher.sglang_servers on GPU 0; skipped where sglang
  or CUDA is missing (always, on our machines), so that the same suite runs against SGLang where it can.
What only our server does (the built-in engine's 400s for features it lacks, token ids equal to
transformers' greedy decoding on CPU, gloo weight sync) is asked through the `ours` fixture or the
`is_ours` flag, which skip those tests or asserts for the sglang variant.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from dataclasses import dataclass

import httpx
import pytest
import torch

from tests.helpers import free_port, service_process
from tests.trainer.test_rollout_engine import encode, hf_greedy, varied_model
from trainer.rollout.client import HttpReplica, RolloutRequestError, _older
from trainer.rollout.sglang_fields import GENERATE_FIELDS, GENERATE_REFUSED, SAMPLING_FIELDS, SAMPLING_REFUSED
from trainer.rollout.weight_group import DEFAULT_GROUP_NAME, init_weight_group

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

# srt/managers/load_snapshot.py `LoadSnapshot`: the flat "core" keys of each /v1/loads entry (every struct
# field but the optional sections memory, speculative, lora, disaggregation, queues)
LOAD_SNAPSHOT_CORE = set(
    """timestamp dp_rank num_running_reqs num_waiting_reqs num_waiting_uncached_tokens num_used_tokens
num_total_tokens num_active_tokens num_prealloc_ready_tokens max_total_num_tokens max_running_requests
token_usage gen_throughput cache_hit_rate utilization total_prefill_uncached_tokens total_prefill_busy_us
decode_moments""".split()
)

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


@dataclass(frozen=True)
class Served:
    url: str
    kind: str  # "ours" | "sglang"


def sglang_unavailable() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    if not torch.cuda.is_available():
        return "SGLang needs CUDA"
    return None


@pytest.fixture(scope="module", params=["ours", "sglang"])
def served(request, models):
    if request.param == "ours":
        with service_process("trainer.rollout.server", "--model", models["first"][1], *SERVER_ARGS) as (
            url,
            _,
        ):
            yield Served(url, "ours")
        return
    if (why := sglang_unavailable()) is not None:
        pytest.skip(why)
    from trainer.rollout.launcher import sglang_servers

    launched = sglang_servers(
        models["first"][1],
        ["0"],
        mem_fraction_static=0.3,
        deterministic_inference=True,  # the seeded-sampling test needs it
        extra_args=["--context-length", str(CONTEXT), "--max-running-requests", "8"],
    )
    with launched as servers:  # started (up to 900 s for /health), stopped on exit
        yield Served(servers.urls[0], "sglang")


@pytest.fixture
def server(served) -> str:
    return served.url


@pytest.fixture
def is_ours(served) -> bool:
    """For the asserts only our server makes, inside tests both servers run."""
    return served.kind == "ours"


@pytest.fixture
def ours(served) -> str:
    """The server, for tests of what only ours does; skipped for SGLang."""
    if served.kind != "ours":
        pytest.skip("our server only: the built-in engine's own behaviour")
    return served.url


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


def test_every_generate_field_unset_and_every_sampling_field_at_its_default_is_accepted(
    server, models, is_ours
):
    """managers/io_struct.py GenerateReqInput (all None-able), sampling/sampling_params.py defaults."""
    prompt = encode(models["tok"])[0]
    body = {name: None for name in GENERATE_REQ_INPUT}
    body.update(
        input_ids=prompt, sampling_params={**SAMPLING_DEFAULTS, "max_new_tokens": 4, "temperature": 0}
    )
    body.update(stream=False, return_logprob=True, return_text_in_logprobs=False)
    out = generate(server, **body)
    if is_ours:
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


def set_value(field: str):
    """A value of the field's type in io_struct.py that is not "unset" (sglang_fields.is_unset)."""
    if field.startswith(("return_", "use_", "need_", "require_")) or field == "background":
        return True
    if field.endswith(("_port", "_room", "_size", "_tokens", "_assigned", "_patch", "_rank")):
        return 2
    special = {
        "input_embeds": [[0.1, 0.2]],
        "image_data": "https://example.com/cat.png",
        "session_params": {"id": "s"},
        "token_ids_logprob": [1, 2],
        "modalities": ["image"],
        "mm_processor_kwargs": {"k": 1},
        "multi_item_delimiter_indices": [0],  # a position list is set even when it names token 0
        "token_indices_to_pool": [0],
    }
    return special.get(field, "x")


# a value that switches each refused sampling feature on (sampling_params.py)
SAMPLING_ON = {
    "min_p": 0.1,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.2,
    "min_new_tokens": 2,
    "beam_width": 2,
    "stop_regex": "a+",
    "json_schema": '{"type": "object"}',
    "regex": "a+",
    "ebnf": 'root ::= "a"',
    "structural_tag": '{"type": "structural_tag"}',
    "logit_bias": {"5": 1.0},
    "watermark": {"key": 1},
    "choice": ["yes", "no"],
}


def test_every_refused_sampling_field_has_a_value_here():
    assert set(SAMPLING_ON) == set(SAMPLING_REFUSED)


@pytest.mark.parametrize("field", sorted(GENERATE_REFUSED))
def test_a_field_the_engine_cannot_honour_is_sglangs_400_naming_it(ours, field):
    """entrypoints/http_server.py `_create_error_response`: 400 {"error": {"message"}}. Every field of
    sglang_fields.GENERATE_REFUSED, set."""
    response = post(ours, "/generate", {"input_ids": [5, 6], field: set_value(field)})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


@pytest.mark.parametrize("field", sorted(SAMPLING_REFUSED))
def test_a_sampling_feature_the_engine_lacks_is_a_400_naming_it(ours, field):
    """Every key of sglang_fields.SAMPLING_REFUSED, switched on."""
    response = post(ours, "/generate", {"input_ids": [5, 6], "sampling_params": {field: SAMPLING_ON[field]}})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "sampling, words",
    [
        (
            {"not_a_sampling_key": 1},
            "not_a_sampling_key",
        ),  # api_types.py SamplingParams: unknown keys rejected
        ({"top_k": 0}, "top_k"),  # sampling_params.py verify(): top_k -1 or >= 1
        ({"max_new_tokens": -1}, "max_new_tokens"),  # sampling_params.py verify(): >= 0
    ],
)
def test_sampling_params_sglang_rejects_are_400s_naming_the_key(server, sampling, words):
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


def test_max_new_tokens_zero_is_prefill_only_with_input_logprobs(server, models, is_ours):
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
    if not is_ours:  # the values below are float32 on CPU; SGLang computes in bfloat16 on GPU
        return
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


def test_server_info_load_and_model_routes(server, models, is_ours):
    """http_server.py /server_info (server args + internal_states + version), /get_load (legacy shape),
    v1_loads.py /v1/loads (managers/load_snapshot.py LoadSnapshot.to_dict: every core key), /model_info,
    /v1/models (openai/protocol.py ModelCard, ModelList)."""
    info = httpx.get(server + "/get_server_info").json()
    assert (info["tp_size"], info["dp_size"]) == (1, 1) and isinstance(info["internal_states"], list)
    if is_ours:  # SGLang sizes its KV pool from GPU memory, and reports the version installed
        assert info["max_total_num_tokens"] == 8 * CONTEXT and info["version"] == "0.5.23"
    load = httpx.get(server + "/get_load").json()
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}
    loads = httpx.get(server + "/v1/loads").json()
    assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    core = loads["loads"][0]
    assert set(core) >= LOAD_SNAPSHOT_CORE and core["dp_rank"] == 0  # SGLang adds its optional sections
    if is_ours:
        assert set(core) == LOAD_SNAPSHOT_CORE and core["max_running_requests"] == 8
        assert core["max_total_num_tokens"] == 8 * CONTEXT and core["num_running_reqs"] == 0
        assert isinstance(core["timestamp"], float) and core["decode_moments"] is None
    models_list = httpx.get(server + "/v1/models").json()
    card = models_list["data"][0]
    assert models_list["object"] == "list" and card["object"] == "model" and card["max_model_len"] == CONTEXT
    assert httpx.get(server + "/v1/models/" + card["id"]).json()["id"] == card["id"]
    assert httpx.get(server + "/v1/models/nope").json()["error"]["code"] == "model_not_found"


def test_weight_version_routes(server, is_ours):
    """http_server.py /update_weight_version ({"success", "message", "new_version"}); /get_weight_version
    ({"weight_version"}) as older releases and slime's engine read it."""
    answer = post(server, "/update_weight_version", {"new_version": "step-7"}).json()
    assert answer == {"success": True, "message": "Weight version updated to step-7", "new_version": "step-7"}
    if is_ours:  # older SGLang releases' route (slime reads it); 0.5.23 has only /model_info
        assert httpx.get(server + "/get_weight_version").json() == {"weight_version": "step-7"}
    assert httpx.get(server + "/model_info").json()["weight_version"] == "step-7"
    assert post(server, "/update_weight_version", {}).status_code == 400


def test_openai_chat_and_completions(server, models, is_ours):
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
    # ignore_eos (SGLang's extension, ours too): a random model samples its EOS at times, ending early
    body = {"prompt": "2 + 3 =", "max_tokens": 3, "logprobs": 0, "ignore_eos": True}
    completion = post(server, "/v1/completions", body).json()
    assert (
        completion["object"] == "text_completion" and len(completion["choices"][0]["logprobs"]["tokens"]) == 3
    )
    if not is_ours:  # SGLang serves tools (with a tool-call parser); the built-in server refuses them
        return
    refused = post(server, "/v1/chat/completions", {"messages": messages, "tools": [{"type": "function"}]})
    assert (
        refused.status_code == 400
        and refused.json()["object"] == "error"
        and "tools" in refused.json()["message"]
    )


# ------------------------------------------------------------------------------- client flows


def test_slime_and_verl_style_client_flows(server, models, is_ours):
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
    assert httpx.get(server + "/model_info").json()["weight_version"] == "2"
    # verl
    out = generate(
        server, input_ids=prompt, sampling_params=short(max_new_tokens=6), return_logprob=True, rid="v-1"
    )
    assert out["meta_info"]["weight_version"] == "2"
    if is_ours:  # the same tokens as transformers on CPU (SGLang runs bfloat16 on GPU)
        assert out["output_ids"] == hf_greedy(second, prompt, 6)
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
    restored = generate(server, input_ids=prompt, sampling_params=short(max_new_tokens=6))["output_ids"]
    assert not is_ours or restored == hf_greedy(first, prompt, 6)


class WeightSender:
    """A trainer's end of the distributed weight update (slime's and verl's), for one server: rank 0 of a
    group with the server's ranks 1..tp_size. Each HTTP call runs together with rank 0's own part of it,
    since neither returns before the other side has joined in."""

    def __init__(self, replica: HttpReplica, *, port: int) -> None:
        self.replica, self.port = replica, port
        self.group = None

    async def connect(self) -> None:
        world_size = 1 + int((await self.replica.server_info()).get("tp_size") or 1)
        where = {"master_address": "127.0.0.1", "master_port": self.port, "world_size": world_size}
        join = {**where, "rank_offset": 1, "group_name": DEFAULT_GROUP_NAME, "backend": "gloo"}
        own = asyncio.to_thread(init_weight_group, **where, rank=0, group_name=DEFAULT_GROUP_NAME)
        self.group, _ = await asyncio.gather(own, self.replica._checked("/init_weights_update_group", join))

    async def send(self, named_tensors: dict, *, weight_version: str) -> None:
        """Every tensor, in the order of the metadata; returns once the server loaded them."""
        tensors = {name: t.detach().contiguous() for name, t in named_tensors.items()}
        metadata = {
            "names": list(tensors),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "group_name": DEFAULT_GROUP_NAME,
            "weight_version": weight_version,
        }

        def broadcast() -> None:
            for tensor in tensors.values():
                torch.distributed.broadcast(tensor, src=0, group=self.group)

        update = self.replica._checked("/update_weights_from_distributed", metadata)
        await asyncio.gather(asyncio.to_thread(broadcast), update)

    def close(self) -> None:
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)


def test_distributed_weight_update_over_gloo(ours, models):
    """Ours only: gloo on CPU (SGLang joins the group with NCCL on its GPU).
    model_runner_components/weight_updater.py: /init_weights_update_group joins rank_offset + tp_rank
    to the trainer's group (rank 0), /update_weights_from_distributed receives one broadcast per tensor."""
    first, _ = models["first"]
    second, _ = models["second"]
    prompt = encode(models["tok"])[3]

    async def run() -> None:
        replica = HttpReplica(ours)
        sender = WeightSender(replica, port=free_port())
        try:
            await sender.connect()
            await sender.send(second.state_dict(), weight_version="dist-1")
            assert httpx.get(ours + "/get_model_info").json()["weight_version"] == "dist-1"
            ids = (await replica.generate({"input_ids": prompt, "sampling_params": short(max_new_tokens=6)}))[
                0
            ]
            assert ids["output_ids"] == hf_greedy(second, prompt, 6) != hf_greedy(first, prompt, 6)
            await sender.send(first.state_dict(), weight_version="dist-2")
        finally:
            sender.close()
            await replica._checked("/destroy_weights_update_group", {"group_name": DEFAULT_GROUP_NAME})
            await replica.close()

    asyncio.run(run())
    assert generate(ours, input_ids=prompt, sampling_params=short(max_new_tokens=6))[
        "output_ids"
    ] == hf_greedy(first, prompt, 6)


def test_seeded_samples_of_a_prompt_differ_and_repeat(server, models):
    """A GRPO group under seeded sampling: the manager gives each sample its own sampling_seed."""
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.manager import http_manager

    tok = models["tok"]
    manager = http_manager([server])
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=5)
        group = [r.response_ids.tolist() for r in manager.generate(encode(tok)[:1], sampling)]
        assert len({tuple(ids) for ids in group}) > 1
        assert [r.response_ids.tolist() for r in manager.generate(encode(tok)[:1], sampling)] == group
    finally:
        manager.close()


def test_seed_version_gate():
    """sampling_seed arrived in SGLang 0.5.3 (sgl-project/sglang#10678)."""
    assert _older("0.5.2", (0, 5, 3)) and _older("0.4.10.post2", (0, 5, 3))
    assert not _older("0.5.3", (0, 5, 3)) and not _older("0.5.23", (0, 5, 3)) and not _older("dev", (0, 5, 3))

    async def run() -> None:
        replica = HttpReplica("http://127.0.0.1:9")  # never reached: the version is already known
        replica._info = {"version": "0.5.2"}
        try:
            with pytest.raises(RolloutRequestError, match="0.5.2 has no sampling_params.sampling_seed"):
                await replica.generate({"input_ids": [1], "sampling_params": {"sampling_seed": 3}})
        finally:
            await replica.close()

    asyncio.run(run())
