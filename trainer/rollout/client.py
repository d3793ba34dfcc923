"""HttpReplica: one rollout server (SGLang or built-in) seen through SGLang's native HTTP API.

One method per route (rollout/protocol.py lists them and their SGLang source). Errors come in two kinds,
because the replica pool acts on the difference:
- ReplicaDown: the replica did not answer (connection refused or reset, timeout) or answered 5xx / 429:
  the request is fine, the replica is not; the pool sends it elsewhere.
- RolloutRequestError: a 4xx other than 429: the request is wrong; resending it anywhere fails again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx

from trainer.rollout.base import Rollout, derived_seed
from trainer.rollout.protocol import rollouts_from_outputs

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# sampling_params.sampling_seed arrived in sgl-project/sglang#10678 (merged 2025-09-20), first released in
# 0.5.3; older servers build SamplingParams(**sampling_params) and answer 400 for the unknown key
SEED_SINCE = (0, 5, 3)


def _has_seed(sampling) -> bool:
    items = sampling if isinstance(sampling, list) else [sampling]
    return any(isinstance(p, dict) and p.get("sampling_seed") is not None for p in items)


def _older(version: str, than: tuple[int, ...]) -> bool:
    """'0.4.10.post2' < (0, 5, 3); a version that does not parse counts as new (our server, a dev build)."""
    parts = []
    for piece in version.split(".")[: len(than)]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            return False
        parts.append(int(digits))
    return tuple(parts) < than


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


class HttpReplica:
    def __init__(
        self, url: str, *, timeout_s: float = 3600.0, token: str | None = None, name: str | None = None
    ) -> None:
        """timeout_s bounds one call; a /generate of long responses can take minutes."""
        self.url = url.rstrip("/")
        self.name = name or self.url
        self._info: dict | None = None  # /get_server_info as the server started, asked once
        self._warned_nondeterministic = False
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
        if _has_seed(payload.get("sampling_params")):
            await self.check_seed_support()
        body = (await self._call("POST", "/generate", payload)).json()
        return body if isinstance(body, list) else [body]

    async def rollouts(self, payload: dict, prompt_index: int) -> list[Rollout]:
        """One prompt's /generate (return_logprob on) as Rollouts. A seeded prompt of n samples goes as n
        requests of n=1, each with its own seed: SGLang gives all n samples of a request one seed."""
        params = payload["sampling_params"]
        seed, n = params.get("sampling_seed"), params.get("n", 1)
        if seed is None or n == 1:
            return rollouts_from_outputs(payload["input_ids"], prompt_index, await self.generate(payload))

        singles = [
            {
                **payload,
                "sampling_params": {**params, "n": 1, "sampling_seed": derived_seed(seed, prompt_index, j)},
            }
            for j in range(n)
        ]
        outputs = await asyncio.gather(*(self.generate(single) for single in singles))
        return rollouts_from_outputs(payload["input_ids"], prompt_index, [o for out in outputs for o in out])

    async def check_seed_support(self) -> None:
        """Refuse, naming the versions, a seeded request to an SGLang older than sampling_seed: it would
        answer 400 for the unknown key (or, behind a lenient proxy, sample unseeded). Warn once when the
        server says it runs without --enable-deterministic-inference: SGLang then ignores sampling_seed
        (sampling_batch_info.py builds the seeds only in that mode), so samples are random, not seeded."""
        if self._info is None:
            self._info = await self.server_info()
        info = self._info
        version = info.get("version")
        if version is not None and _older(version, SEED_SINCE):
            raise RolloutRequestError(
                f"{self.url}: SGLang {version} has no sampling_params.sampling_seed (added in "
                f"{'.'.join(map(str, SEED_SINCE))}); upgrade SGLang or leave the rollout seed unset",
                400,
            )
        if info.get("enable_deterministic_inference") is False and not self._warned_nondeterministic:
            self._warned_nondeterministic = True
            log.warning(
                "%s runs without --enable-deterministic-inference: SGLang ignores sampling_seed there, so "
                "rollouts are sampled unseeded and do not repeat on a rerun or resume",
                self.url,
            )

    async def update_weights_from_disk(
        self, model_path: str, *, load_format: str | None = None, weight_version: str | None = None
    ) -> None:
        payload = {"model_path": model_path, "load_format": load_format, "weight_version": weight_version}
        await self._checked("/update_weights_from_disk", payload)

    async def _checked(self, path: str, payload: dict) -> None:
        body = (await self._call("POST", path, payload)).json()
        if isinstance(body, dict) and body.get("success") is False:
            raise RolloutRequestError(f"{self.url}{path}: {body.get('message')}", 400)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._call("POST", "/release_memory_occupation", {"tags": list(tags) if tags else None})

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._call("POST", "/resume_memory_occupation", {"tags": list(tags) if tags else None})

    async def server_info(self) -> dict:
        return (await self._call("GET", "/get_server_info")).json()

    async def health(self) -> bool:
        try:
            response = await self._http.get(self.url + "/health", timeout=10.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def close(self) -> None:
        await self._http.aclose()
