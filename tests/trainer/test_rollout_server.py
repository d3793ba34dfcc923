"""The rollout server (built-in engine behind SGLang's native API), its client, the replica pool, the
manager and the launcher, all on CPU with real uvicorn processes on loopback ports.

SGLang itself cannot be installed here (nor on the GPU machine): the SGLang side of the protocol is
checked against its source (rollout/protocol.py cites it), the launcher's SGLang command line is checked
as argv, and the client that drives SGLang is exercised against our server.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch

from tests.helpers import builtin_servers, service_process
from tests.trainer.test_rollout_engine import encode, engine_for, hf_greedy, varied_model
from trainer.rollout.base import SamplingParams, derived_seed
from trainer.rollout.builtin.worker import EngineWorker
from trainer.rollout.client import HttpReplica, ReplicaDown, RolloutRequestError
from trainer.rollout.launcher import gpu_groups, sglang_command, sglang_servers
from trainer.rollout.local import LocalReplica
from trainer.rollout.manager import RolloutManager, host_tensors, http_manager
from trainer.rollout.pool import ReplicaPool, RolloutUnavailable

SERVER_ARGS = ("--device", "cpu", "--max-running-requests", "8", "--context-length", "160")


def save_model(model, tok, path):
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-server")
    first, tok = varied_model("qwen2", seed=3)
    second, _ = varied_model("qwen2", seed=99)
    return {
        "tok": tok,
        "first": (first, save_model(first, tok, root / "first")),
        "second": (second, save_model(second, tok, root / "second")),
    }


@pytest.fixture(scope="module")
def server(models):
    with service_process("trainer.rollout.server", "--model", models["first"][1], *SERVER_ARGS) as (url, _):
        yield url


def post(url, path, payload=None):
    return httpx.post(url + path, json=payload, timeout=120)


def greedy(max_new_tokens=10, **extra):
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


# ------------------------------------------------------------------------------------ the wire


def test_generate_answers_in_sglangs_format(server, models):
    model, _ = models["first"]
    tok = models["tok"]
    prompts = encode(tok)[:3]
    body = {"input_ids": prompts, "sampling_params": greedy(n=2), "return_logprob": True}
    response = post(server, "/generate", body)
    assert response.status_code == 200, response.text
    items = response.json()
    assert len(items) == 6  # prompt-major: prompt i's 2 samples are items 2i and 2i+1
    for index, item in enumerate(items):
        prompt = prompts[index // 2]
        assert item["output_ids"] == hf_greedy(model, prompt, 10)
        meta = item["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 10}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), 10)
        assert [pair[1] for pair in meta["output_token_logprobs"]] == item["output_ids"]
        assert all(pair[0] <= 0 and pair[2] is None for pair in meta["output_token_logprobs"])
        assert item["text"] == tok.decode(item["output_ids"], skip_special_tokens=True)
    single = post(server, "/generate", {"input_ids": prompts[0], "sampling_params": greedy(4)}).json()
    assert isinstance(single, dict) and "output_token_logprobs" not in single["meta_info"]


def test_stop_string_is_trimmed_from_the_text_not_from_the_ids(server, models):
    tok = models["tok"]
    prompt = encode(tok)[0]
    full = post(server, "/generate", {"input_ids": prompt, "sampling_params": greedy(12)}).json()
    text = full["text"]
    stop = text[5:7]
    cut = post(
        server,
        "/generate",
        {"input_ids": prompt, "sampling_params": greedy(12, stop=stop, no_stop_trim=False)},
    ).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.index(stop)]
    assert tok.decode(cut["output_ids"]).endswith(stop)  # the ids keep the tokens that made the stop string


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"input_ids": [5], "image_data": "cat.png"}, 400, "image_data is not supported"),
        ({"input_ids": [[]]}, 400, "non-empty"),
        ({"input_ids": [5] * 150, "sampling_params": {"max_new_tokens": 20}}, 400, "context length 160"),
        ({"input_ids": [5, 99999]}, 400, "token ids must be in"),
        ({"input_ids": [5], "sampling_params": {"top_k": 0}}, 400, "top_k"),
        ({"input_ids": [5], "sampling_params": {"regex": "a+"}}, 400, "regex is not supported"),
        ({"input_ids": [5], "sampling_params": {"min_p": 0.1}}, 400, "min_p"),
        ({"input_ids": [5], "sampling_params": {"temperature": -1}}, 400, "temperature"),
        ({"input_ids": [5], "stream": True}, 400, "stream"),
        ({"input_ids": [[5], [6]], "sampling_params": [{"n": 1}, {"n": 2}]}, 400, "same n"),
        ({"input_ids": [5], "top_logprobs_num": 5}, 400, "top_logprobs_num"),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_problem(server, body, status, words):
    response = post(server, "/generate", body)
    assert response.status_code == status, response.text
    assert words in response.text


def test_model_info_flush_cache_and_server_info(server, models):
    info = httpx.get(server + "/get_model_info").json()
    assert info["model_path"] == models["first"][1] and info["is_generation"] is True
    assert httpx.get(server + "/model_info").json()["weight_version"] == info["weight_version"]
    assert post(server, "/flush_cache").status_code == 200
    state = httpx.get(server + "/get_server_info").json()
    assert state["engine"] == "builtin" and state["max_running_requests"] == 8 and not state["cuda_graphs"]


def test_release_and_resume_memory_occupation(server, models):
    prompt = encode(models["tok"])[0]
    before = post(server, "/generate", {"input_ids": prompt, "sampling_params": greedy(6)}).json()
    assert post(server, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    refused = post(server, "/generate", {"input_ids": prompt})
    assert refused.status_code == 409 and "released" in refused.text
    assert post(server, "/resume_memory_occupation", {}).status_code == 200
    after = post(server, "/generate", {"input_ids": prompt, "sampling_params": greedy(6)}).json()
    assert after["output_ids"] == before["output_ids"] and after["text"] == before["text"]
    assert post(server, "/release_memory_occupation", {"tags": ["disk"]}).status_code == 400
    # io_struct.py: BaseReq's rid / http_worker_ipc and SGLang's third tag; the graphs go with the KV cache
    # here, so "cuda_graph" alone releases nothing and generation goes on
    sglang_body = {"tags": ["cuda_graph"], "rid": "r-1", "http_worker_ipc": None, "not_a_field": 1}
    assert post(server, "/release_memory_occupation", sglang_body).status_code == 200
    still = post(server, "/generate", {"input_ids": prompt, "sampling_params": greedy(6)}).json()
    assert still["output_ids"] == before["output_ids"]
    assert post(server, "/resume_memory_occupation", sglang_body).status_code == 200


def test_weight_updates_from_disk_and_from_tensors_change_the_outputs(server, models):
    first, first_dir = models["first"]
    second, second_dir = models["second"]
    prompt = encode(models["tok"])[2]

    def greedy_ids():
        return post(server, "/generate", {"input_ids": prompt, "sampling_params": greedy(10)}).json()[
            "output_ids"
        ]

    assert greedy_ids() == hf_greedy(first, prompt, 10)
    answer = post(server, "/update_weights_from_disk", {"model_path": second_dir, "weight_version": "v2"})
    assert answer.json()["success"] is True
    assert greedy_ids() == hf_greedy(second, prompt, 10) != hf_greedy(first, prompt, 10)
    assert httpx.get(server + "/get_model_info").json()["weight_version"] == "v2"

    tensors = base64.b64encode(safetensors.torch.save(host_tensors(first.state_dict()))).decode()
    payload = {"serialized_named_tensors": [tensors], "load_format": "safetensors"}
    assert post(server, "/update_weights_from_tensor", payload).json()["success"] is True
    assert greedy_ids() == hf_greedy(first, prompt, 10)
    missing = post(server, "/update_weights_from_disk", {"model_path": "/no/such/folder"})
    assert missing.status_code == 400 and "safetensors" in missing.text
    pickled = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]})
    assert pickled.status_code == 400 and "CUDA-IPC" in pickled.text
    garbage = {"serialized_named_tensors": [base64.b64encode(b"junk").decode()], "load_format": "safetensors"}
    assert post(server, "/update_weights_from_tensor", garbage).status_code == 400
    assert greedy_ids() == hf_greedy(first, prompt, 10)  # a refused update changed nothing


# ------------------------------------------------------------------------------------ manager, pool


def test_http_manager_gives_the_same_rollouts_as_the_engine_in_process(server, models):
    model, model_dir = models["first"]
    tok = models["tok"]
    prompts = encode(tok)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=11)
    manager = http_manager([server], config_dir=model_dir)
    try:
        rollouts = manager.generate(prompts, sampling)
        # the same seeds in process: prompt i is seeded derived_seed(11, i, 0) by the manager, and its sample
        # j is sent alone by the HTTP replica, seeded derived_seed(that, i, j)
        engine = engine_for(model, tok)
        expected = [
            engine.generate(
                [p],
                SamplingParams(
                    temperature=1.0, max_new_tokens=12, n=1, seed=derived_seed(derived_seed(11, i, 0), i, j)
                ),
            )[0]
            for i, p in enumerate(prompts)
            for j in range(2)
        ]
        assert [r.response_ids.tolist() for r in rollouts] == [
            s.token_ids for group in expected for s in group
        ]
        for rollout, sample in zip(rollouts, [s for group in expected for s in group]):
            assert rollout.logprobs.tolist() == pytest.approx(
                sample.logprobs, rel=1e-5, abs=1e-5
            )  # batched vs alone
            assert rollout.finish_reason == sample.finish_reason
        # load_weights through a checkpoint on disk, then back
        second, _ = models["second"]
        manager.load_weights(second)
        greedy_rollouts = manager.generate(
            prompts[:2], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        )
        assert [r.response_ids.tolist() for r in greedy_rollouts] == [
            hf_greedy(second, p, 8) for p in prompts[:2]
        ]
        manager.load_weights(model.state_dict())
        greedy_rollouts = manager.generate(
            prompts[:2], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        )
        assert [r.response_ids.tolist() for r in greedy_rollouts] == [
            hf_greedy(model, p, 8) for p in prompts[:2]
        ]
    finally:
        manager.close()


def local_replica(model, tok, name, **config):
    return LocalReplica(EngineWorker(engine_for(model, tok, **config)), tok, name=name, with_text=False)


def test_pool_routes_to_the_least_loaded_replica_and_retries_a_dead_ones_requests(models):
    model, _ = models["first"]
    tok = models["tok"]
    fast, doomed = local_replica(model, tok, "fast"), local_replica(model, tok, "doomed")
    pool = ReplicaPool([fast, doomed], capacity=4)
    manager = RolloutManager(pool)
    prompts = encode(tok) * 2
    sampling = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    try:
        rollouts = manager.generate(prompts, sampling)
        assert [r.response_ids.tolist() for r in rollouts] == [hf_greedy(model, p, 6) for p in prompts]
        assert all(m.served > 0 for m in pool.members)  # both replicas took work
        doomed.worker.close()  # an in-process replica that died: its requests fail, the pool resends them
        rollouts = manager.generate(prompts, sampling)
        assert [r.response_ids.tolist() for r in rollouts] == [hf_greedy(model, p, 6) for p in prompts]
        assert pool.alive == [fast] and pool.retried > 0
        fast.worker.close()
        with pytest.raises(RolloutUnavailable):
            manager.generate(prompts[:1], sampling)
    finally:
        manager.close()


def test_a_replica_that_dies_mid_batch_has_its_requests_retried_elsewhere(models):
    model, model_dir = models["first"]
    tok = models["tok"]
    prompts = encode(tok) * 2
    sampling = SamplingParams(temperature=0, max_new_tokens=80, ignore_eos=True)
    expected = [
        g[0].token_ids for g in engine_for(model, tok, context_length=160).generate(prompts, sampling)
    ]
    # two real servers, started by the launcher (as rollout.name=sglang starts SGLang), one slot each: the
    # pool splits the 10 prompts between them, so the victim holds running and queued requests when it dies
    with builtin_servers(model_dir, 2, "--max-running-requests", "1", "--context-length", "160") as servers:
        survivor, victim = servers.servers
        manager = http_manager(servers.urls)

        async def scenario():
            batch = asyncio.ensure_future(manager.generate_async(prompts, sampling))
            async with httpx.AsyncClient() as http:
                while True:
                    state = (await http.get(victim.url + "/get_server_info")).json()
                    if state["running_sequences"] and state["waiting_sequences"] >= 2:
                        break
                    await asyncio.sleep(0.02)  # until the victim is decoding one request and holds more
            os.killpg(victim.process.pid, signal.SIGKILL)
            return await batch

        try:
            rollouts = asyncio.run(scenario())
            assert [r.response_ids.tolist() for r in rollouts] == expected
            assert manager.pool.retried >= 3
            assert [r.url for r in manager.pool.alive] == [survivor.url]
        finally:
            manager.close()


async def _call_dead():
    replica = HttpReplica("http://127.0.0.1:9", timeout_s=5)
    try:
        await replica.generate({"input_ids": [1]})
    finally:
        await replica.close()


def test_client_error_kinds(server):
    with pytest.raises(ReplicaDown):
        asyncio.run(_call_dead())

    async def bad():
        replica = HttpReplica(server)
        try:
            await replica.generate({"input_ids": [5], "sampling_params": {"top_k": 0}})
        finally:
            await replica.close()

    with pytest.raises(RolloutRequestError, match="top_k") as caught:
        asyncio.run(bad())
    assert caught.value.status_code == 400


# ------------------------------------------------------------------------------------ launcher


def test_sglang_command_line():
    argv = sglang_command(
        "/models/qwen",
        port=30001,
        tp_size=2,
        mem_fraction_static=0.5,
        extra_args=["--log-level", "warning"],
    )
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[3:] == [
        "--model-path",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tp-size",
        "2",
        "--dtype",
        "bfloat16",
        "--mem-fraction-static",
        "0.5",
        "--enable-memory-saver",
        "--log-level",
        "warning",
    ]
    assert "--enable-deterministic-inference" not in argv
    seeded = sglang_command("/models/qwen", port=30001, deterministic_inference=True)
    assert seeded[-1] == "--enable-deterministic-inference"
    # the launcher's servers for a seeded run (build_rollout passes seeded=True: the loop always seeds)
    started = sglang_servers("/models/qwen", ["0", "1"], deterministic_inference=True).servers
    assert all("--enable-deterministic-inference" in server.argv for server in started)
    assert "--trust-remote-code" not in seeded
    assert sglang_command("/models/custom", port=30002, trust_remote_code=True)[-1] == "--trust-remote-code"
    # data.tokenizer: started servers detokenize and stop with the driver's tokenizer, not the model's
    assert "--tokenizer-path" not in seeded
    with_tokenizer = sglang_command("/models/qwen", port=30003, tokenizer_path="/tok")
    assert with_tokenizer[-2:] == ["--tokenizer-path", "/tok"]
    assert gpu_groups(["0", "1", "2", "3"], 2) == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="tensor-parallel"):
        gpu_groups(["0", "1", "2"], 2)


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    servers = builtin_servers(str(tmp_path / "missing"), 1)
    with pytest.raises(RuntimeError, match="exited with") as caught:
        servers.start(timeout_s=120)
    assert "missing" in str(caught.value)


def test_build_rollout_for_each_name(server, models):
    """hf and builtin: the policy ranks' engines as replicas; sglang: servers at the given URLs."""
    from trainer.rollout.manager import build_rollout
    from trainer.workers.engines import KV_CACHE, EngineSettings, colocated_replica

    model, model_dir = models["first"]
    tok = models["tok"]
    prompts = encode(tok)[:2]
    greedy_sampling = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    expected = [hf_greedy(model, p, 6) for p in prompts]
    for name in ("hf", "builtin", "sglang"):
        replicas = []
        if name != "sglang":
            settings = EngineSettings(name=name, context_length=96)
            replica = colocated_replica(
                settings,
                model,
                tok,
                device=torch.device("cpu"),
                model_path=model_dir,
                trust_remote_code=False,
                name=name,
            )
            replicas = [replica]
        urls = [server] if name == "sglang" else []
        manager = build_rollout(name, replicas=replicas, model_path=model_dir, server_urls=urls)
        try:
            asyncio.run(manager.resume_memory_async(KV_CACHE))
            assert [
                r.response_ids.tolist() for r in manager.generate(prompts, greedy_sampling)
            ] == expected, name
        finally:
            manager.close()
    with pytest.raises(ValueError, match="needs server URLs"):
        build_rollout("sglang", model_path=model_dir)


def test_weight_checkpoints_go_to_the_shared_folder_the_env_names(server, models, tmp_path, monkeypatch):
    """ROLLOUT_WEIGHTS_DIR (a path remote servers share) -> build_rollout -> the manager's checkpoints,
    which the server then loads from there."""
    from trainer.rollout.manager import build_rollout, weights_dir_from_env

    first, first_dir = models["first"]
    second, _ = models["second"]
    tok = models["tok"]
    shared = tmp_path / "shared" / "rollout-weights"  # not there yet: build_rollout creates it
    monkeypatch.setenv("ROLLOUT_WEIGHTS_DIR", str(shared))
    manager = build_rollout(
        "sglang",
        model_path=first_dir,
        server_urls=[server],
        weights_dir=weights_dir_from_env(),
    )
    prompt = encode(tok)[1]
    try:
        assert shared.is_dir()
        manager.load_weights(second.state_dict())
        assert (shared / "latest" / "model.safetensors").exists()
        assert httpx.get(server + "/get_model_info").json()["model_path"] == str(shared / "latest")
        sampling = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
        assert manager.generate([prompt], sampling)[0].response_ids.tolist() == hf_greedy(second, prompt, 6)
    finally:
        manager.close()
        restore = post(server, "/update_weights_from_disk", {"model_path": first_dir, "weight_version": "r"})
        assert restore.json()["success"] is True
    assert (shared / "latest" / "model.safetensors").exists()  # the user's folder: left as it is


def test_weight_checkpoints_in_a_temporary_folder_are_removed_at_close(server, models):
    """No ROLLOUT_WEIGHTS_DIR: the manager writes to a folder of its own (a full model copy, in /dev/shm
    where there is one) and removes it when it closes."""
    from trainer.rollout.manager import build_rollout

    first, first_dir = models["first"]
    manager = build_rollout("sglang", model_path=first_dir, server_urls=[server])
    try:
        manager.load_weights(models["second"][0].state_dict())
        written = Path(httpx.get(server + "/get_model_info").json()["model_path"])
        assert (written / "model.safetensors").exists()
    finally:
        manager.close()
        restore = post(server, "/update_weights_from_disk", {"model_path": first_dir, "weight_version": "r"})
        assert restore.json()["success"] is True
    assert not written.parent.exists()
