"""services.common: health gating, auth, body limits, JSON errors, metrics, settings, client policy."""

import os
import random
import threading
import time

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from services.common.app import create_service_app, require_ready
from services.common.client import ReplicaSet, backoff_delay, normalize_urls
from services.common.settings import ServiceSettings, parse_cli


class Echo(BaseModel):
    n: int = Field(ge=1, le=10)


def make_app(token=None, max_bytes=2048, load=None):
    settings = ServiceSettings(auth_token=token, max_request_bytes=max_bytes)
    app = create_service_app("test-svc", settings, load=load)

    @app.post("/echo")
    async def echo(body: Echo, state=__import__("fastapi").Depends(require_ready)) -> dict:
        return {"n": body.n}

    return app


def wait_ready(client, timeout=10):
    deadline = time.monotonic() + timeout
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "never became ready"
        time.sleep(0.02)


def test_health_is_503_until_loaded_then_200():
    gate = threading.Event()
    app = make_app(load=lambda app: gate.wait(10))
    with TestClient(app) as client:
        response = client.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "loading"
        assert client.post("/echo", json={"n": 1}).status_code == 503
        gate.set()
        wait_ready(client)
        assert client.get("/health").json()["status"] == "ok"
        assert client.post("/echo", json={"n": 3}).json() == {"n": 3}


def test_failed_load_reports_failed():
    def boom(app):
        raise FileNotFoundError("corpus.jsonl")

    with TestClient(make_app(load=boom)) as client:
        deadline = time.monotonic() + 5
        while client.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.02)
        body = client.get("/health").json()
        assert body["status"] == "failed" and "corpus.jsonl" in body["error"]


def test_validation_error_names_the_field():
    with TestClient(make_app()) as client:
        wait_ready(client)
        response = client.post("/echo", json={"n": 0})
        assert response.status_code == 422
        assert "n:" in response.json()["error"] and response.json()["detail"][0]["field"] == "n"
        response = client.post("/echo", content=b"{not json", headers={"content-type": "application/json"})
        assert response.status_code == 422 and "invalid JSON" in response.json()["error"]


def test_bearer_auth_guards_everything_but_health():
    with TestClient(make_app(token="s3cret")) as client:
        wait_ready(client)
        assert client.get("/health").status_code == 200
        refused = client.post("/echo", json={"n": 1})
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
        assert client.get("/metrics").status_code == 401
        wrong = client.post("/echo", json={"n": 1}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = client.post("/echo", json={"n": 1}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_openapi_documents_what_the_service_answers():
    with TestClient(make_app(token="s3cret")) as client:
        schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components and "ErrorResponse" in components
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    echo = schema["paths"]["/echo"]["post"]["responses"]
    assert set(echo) == {"200", "400", "401", "413", "422", "503"}
    assert all(
        echo[code]["content"]["application/json"]["schema"] == error_ref for code in echo if code != "200"
    )
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    health = schema["paths"]["/health"]["get"]
    assert set(health["responses"]) == {"200", "503"} and health["security"] == []
    assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}


def test_body_limit_with_and_without_content_length():
    with TestClient(make_app(max_bytes=2048)) as client:
        wait_ready(client)
        big = b'{"n": 1, "pad": "' + b"x" * 4096 + b'"}'
        response = client.post("/echo", content=big, headers={"content-type": "application/json"})
        assert response.status_code == 413 and "2048" in response.json()["error"]

        def chunks():  # no Content-Length: chunked transfer
            for _ in range(5):
                yield b"x" * 1000

        response = client.post("/echo", content=chunks(), headers={"content-type": "application/json"})
        assert response.status_code == 413


def test_metrics_count_requests_and_errors():
    with TestClient(make_app()) as client:
        wait_ready(client)
        client.post("/echo", json={"n": 2})
        client.post("/echo", json={"n": 99})
        text = client.get("/metrics").text
        assert 'test_svc_requests_total{method="POST",route="/echo",status="200"} 1.0' in text
        assert 'test_svc_errors_total{route="/echo",status="422"} 1.0' in text
        assert "test_svc_request_duration_seconds_bucket" in text


def test_settings_cli_overrides_env(monkeypatch):
    monkeypatch.setenv("SERVICE_PORT", "9001")
    assert parse_cli(ServiceSettings, []).port == 9001
    assert parse_cli(ServiceSettings, ["--port", "9002"]).port == 9002
    with pytest.raises(SystemExit) as exc:
        parse_cli(ServiceSettings, ["--port", "70000"])
    assert "port" in str(exc.value)


def test_backoff_is_bounded_full_jitter():
    rng = random.Random(0)
    delays = [backoff_delay(attempt, 0.5, 4.0, rng) for attempt in range(10) for _ in range(50)]
    assert all(0 <= d <= 4.0 for d in delays)
    assert max(delays) > 3.0  # the cap is reached, not just the base


def test_replica_set_skips_failed_and_readds():
    replicas = ReplicaSet(normalize_urls("http://a:1, http://b:2/"), cooldown_s=0.2)
    assert [r.url for r in replicas.replicas] == ["http://a:1", "http://b:2"]
    first = replicas.pick()
    replicas.mark_failed(first)
    assert {replicas.pick().url for _ in range(4)} == {r.url for r in replicas.replicas if r is not first}
    time.sleep(0.25)
    assert {replicas.pick().url for _ in range(4)} == {"http://a:1", "http://b:2"}


def test_sync_client_gives_up_with_clear_error():
    from services.common.client import ServiceError, SyncServiceClient
    from tests.helpers import free_port

    client = SyncServiceClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01, timeout_s=1)
    with pytest.raises(ServiceError, match="gave up after 3 attempts"):
        client.get("/health")
    with pytest.raises(ValueError):
        normalize_urls(" , ")


def test_a_service_restarted_after_an_outage_is_waited_out_and_each_retry_is_logged(caplog):
    """A real data-server stops, and comes back on the same port ~15 s later (a job group restarting it):
    the client with a retry deadline waits and gets its answer; without one it gives up in seconds."""
    import asyncio
    import contextlib

    from services.common.client import AsyncServiceClient, ServiceError
    from tests.helpers import free_port, service_process

    port, outage_s = free_port(), 13.0
    args = ("--datasets", "synthetic-arith=synthetic-arith:easy", "--synthetic-train-size", "8")
    with service_process("services.data_server", *args, port=port) as (url, _):
        pass  # it answered /health; now it is stopped
    policy = {"retries": 2, "backoff_s": 0.2, "max_backoff_s": 2.0, "timeout_s": 5.0}

    async def outage(stack: contextlib.ExitStack) -> tuple[dict, float]:
        started = time.monotonic()
        async with (
            AsyncServiceClient(url, deadline_s=60.0, **policy) as waiting,
            AsyncServiceClient(url, **policy) as quick,
        ):
            answer = asyncio.create_task(waiting.get("/v1/datasets"))
            with pytest.raises(ServiceError, match=r"gave up after 3 attempts: .*ConnectError"):
                await quick.get("/v1/datasets")  # the negative control: today's quick retries
            assert time.monotonic() - started < outage_s / 2
            await asyncio.sleep(outage_s - (time.monotonic() - started))
            await asyncio.to_thread(
                stack.enter_context, service_process("services.data_server", *args, port=port)
            )
            return await asyncio.wait_for(answer, 30), time.monotonic() - started

    caplog.set_level("WARNING", logger="services.client")
    with contextlib.ExitStack() as stack:
        body, waited = asyncio.run(outage(stack))
    assert waited >= outage_s and [d["name"] for d in body["datasets"]] == ["synthetic-arith"]
    retries = [r for r in caplog.records if getattr(r, "url", None) == f"{url}/v1/datasets"]
    attempts = [r.attempt for r in retries]
    assert len(attempts) > 5 and attempts[-1] > 4 and all(r.delay_s <= 2.0 for r in retries)
    line = retries[-1].getMessage()
    assert f"retrying {url}/v1/datasets in " in line and f"(attempt {attempts[-1]} failed: " in line


def test_usable_cpus_follows_the_cgroup_quota_that_cpu_count_does_not_see(tmp_path):
    from services.common.settings import usable_cpus

    mask = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == mask  # no cgroup files: the affinity mask
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(v2) == mask
    (v2 / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one
    assert usable_cpus(v2) == 1
    (v2 / "cpu.max").write_text(f"{(mask + 8) * 100000} 100000\n")  # a quota above the mask: the mask
    assert usable_cpus(v2) == mask
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cpus(v1) == mask
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert usable_cpus(v1) == 1
