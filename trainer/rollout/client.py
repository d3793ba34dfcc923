"""HttpReplica: one rollout server (SGLang or built-in) seen through SGLang's native HTTP API.

One method per route (rollout/protocol.py lists them and their SGLang source). Errors come in two kinds,
because the replica pool acts on the difference:
- ReplicaDown: the replica did not answer (connection refused or reset, timeout) or answered 5xx / 429:
  the request is fine, the replica is not; the pool sends it elsewhere.
- RolloutRequestError: a 4xx other than 429: the request is wrong; resending it anywhere fails again.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Mapping, Sequence

import httpx

from trainer.rollout.base import Rollout
from trainer.rollout.protocol import SAFETENSORS_FORMAT, rollouts_from_outputs

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class ReplicaDown(RuntimeError):
    """The replica could not serve the call (not the call's fault)."""


class RolloutRequestError(ValueError):
    """The replica refused the call as invalid (4xx); the message is the replica's."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


def error_message(response: httpx.Response) -> str:
    """The error text of an SGLang ({"error": {"message"}}) or built-in ({"error": "..."}) answer."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    if error is not None:
        return str(error)
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return response.text[:500]


def host_tensors(named_tensors: Mapping) -> dict:
    """Contiguous CPU copies for safetensors, each storage once: tied weights (lm_head = embed_tokens)
    keep their first name only, and the receiving engine ties them again."""
    seen, out = set(), {}
    for name, tensor in named_tensors.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous().cpu()
    return out


class HttpReplica:
    def __init__(
        self, url: str, *, timeout_s: float = 3600.0, token: str | None = None, name: str | None = None
    ) -> None:
        """timeout_s bounds one call; a /generate of long responses can take minutes."""
        self.url = url.rstrip("/")
        self.name = name or self.url
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            headers=headers,
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )

    async def _call(self, method: str, path: str, payload: dict | None = None) -> httpx.Response:
        try:
            response = await self._http.request(method, self.url + path, json=payload)
        except httpx.TransportError as exc:
            raise ReplicaDown(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code < 400:
            return response
        message = f"{self.url}{path}: HTTP {response.status_code}: {error_message(response)}"
        if response.status_code in RETRYABLE_STATUS:
            raise ReplicaDown(message)
        raise RolloutRequestError(message, response.status_code)

    async def generate(self, payload: dict) -> list[dict]:
        """POST /generate; always a list (a single prompt's one answer is wrapped)."""
        body = (await self._call("POST", "/generate", payload)).json()
        return body if isinstance(body, list) else [body]

    async def rollouts(self, payload: dict, prompt_index: int) -> list[Rollout]:
        """One prompt's /generate (return_logprob on) as Rollouts."""
        return rollouts_from_outputs(payload["input_ids"], prompt_index, await self.generate(payload))

    async def update_weights_from_disk(
        self, model_path: str, *, load_format: str | None = None, weight_version: str | None = None
    ) -> None:
        payload = {"model_path": model_path, "load_format": load_format, "weight_version": weight_version}
        await self._checked("/update_weights_from_disk", payload)

    async def update_weights_from_tensor(
        self, named_tensors: Mapping, *, weight_version: str | None = None
    ) -> None:
        """The built-in server's form of the route: one base64 safetensors payload (see protocol.py)."""
        from safetensors.torch import save

        payload = {
            "serialized_named_tensors": [base64.b64encode(save(host_tensors(named_tensors))).decode()],
            "load_format": SAFETENSORS_FORMAT,
            "weight_version": weight_version,
        }
        await self._checked("/update_weights_from_tensor", payload)

    async def _checked(self, path: str, payload: dict) -> None:
        body = (await self._call("POST", path, payload)).json()
        if isinstance(body, dict) and body.get("success") is False:
            raise RolloutRequestError(f"{self.url}{path}: {body.get('message')}", 400)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._call("POST", "/release_memory_occupation", {"tags": list(tags) if tags else None})

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._call("POST", "/resume_memory_occupation", {"tags": list(tags) if tags else None})

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache")

    async def model_info(self) -> dict:
        return (await self._call("GET", "/get_model_info")).json()

    async def server_info(self) -> dict:
        return (await self._call("GET", "/get_server_info")).json()

    async def health(self) -> bool:
        try:
            response = await self._http.get(self.url + "/health", timeout=10.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def wait_healthy(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        """Until /health answers 200 (SGLang: model loaded and warmed up); ReplicaDown on timeout."""
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise ReplicaDown(f"{self.url} not healthy within {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        await self._http.aclose()
