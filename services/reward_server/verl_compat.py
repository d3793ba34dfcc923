"""Use the reward-server from verl: a `custom_reward_function` that scores through HTTP.

    REWARD_SERVER_URL=http://reward-server:8001 python -m verl.trainer.main_ppo ... \\
        custom_reward_function.path=services/reward_server/verl_compat.py \\
        custom_reward_function.name=compute_score

`compute_score` answers both ways verl calls a reward function:
- per item (NaiveRewardManager): compute_score(data_source, solution_str, ground_truth, extra_info)
- batched (reward_model.reward_manager=batch): compute_score(data_sources=[...], solution_strs=[...],
  ground_truths=[...], extra_infos=[...]), one HTTP round trip per server-sized chunk.
Each result is {"score": float, "acc": float}; verl logs "acc" beside the score (val-core/<source>/acc).

Environment: REWARD_SERVER_URL (one URL or a comma-separated list of replicas; required),
REWARD_SERVER_AUTH_TOKEN (when the server wants one), REWARD_SERVER_TIMEOUT_S (default 300),
REWARD_SERVER_RETRIES (default 5; jittered backoff between tries).
A server that stays unreachable after the retries raises ServiceError: a silent 0 would train the
policy on wrong rewards. Items the server could not score (an unknown data_source, a math timeout)
score 0 and are logged once per distinct reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from services.common.client import SyncServiceClient
from services.reward_server.client import chunk_items, encode_item, limits_of, request_body

log = logging.getLogger("services.reward_server.verl_compat")

_clients: dict[str, tuple[SyncServiceClient, tuple[int, int]]] = {}
_reported_errors: set[str] = set()


def _client() -> tuple[SyncServiceClient, tuple[int, int]]:
    """One client per URL per process (verl may run the reward function in several worker processes)."""
    url = os.environ.get("REWARD_SERVER_URL", "").strip()
    if not url:
        raise RuntimeError(
            "REWARD_SERVER_URL is not set: point it at the reward-server, e.g. http://127.0.0.1:8001"
        )
    if url not in _clients:
        client = SyncServiceClient(
            url,
            timeout_s=float(os.environ.get("REWARD_SERVER_TIMEOUT_S", "300")),
            retries=int(os.environ.get("REWARD_SERVER_RETRIES", "5")),
            token=os.environ.get("REWARD_SERVER_AUTH_TOKEN") or None,
        )
        _clients[url] = (client, limits_of(client.get("/v1/scorers")))
    return _clients[url]


def score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence,
    extra_infos: Sequence[dict | None] | None = None,
) -> list[dict]:
    client, (max_items, max_bytes) = _client()
    extra_infos = extra_infos if extra_infos is not None else [None] * len(data_sources)
    encoded = [
        encode_item({"data_source": source, "response": text, "ground_truth": truth, "extra_info": extra})
        for source, text, truth, extra in zip(
            data_sources, solution_strs, ground_truths, extra_infos, strict=True
        )
    ]
    results: list[dict] = []
    for start, stop in chunk_items(encoded, max_items, max_bytes):
        answer = client.request(
            "POST",
            "/v1/rewards",
            content=request_body(encoded[start:stop], None),
            headers={"content-type": "application/json"},
        )
        results.extend(answer["results"])
    for result in results:
        if result["error"] and result["error"] not in _reported_errors:
            _reported_errors.add(result["error"])
            log.warning("reward-server could not score an item (scored 0): %s", result["error"])
    return [{"score": float(r["score"]), "acc": float(r["correct"])} for r in results]


def compute_score(
    data_source=None,
    solution_str=None,
    ground_truth=None,
    extra_info=None,
    *,
    data_sources=None,
    solution_strs=None,
    ground_truths=None,
    extra_infos=None,
    **_verl_kwargs,
):
    """verl's reward-function signature, per item or batched (see the module docstring)."""
    if data_sources is not None or not isinstance(data_source, str):  # a list or numpy array: batched
        return score_batch(
            data_sources if data_sources is not None else data_source,
            solution_strs if solution_strs is not None else solution_str,
            ground_truths if ground_truths is not None else ground_truth,
            extra_infos if extra_infos is not None else extra_info,
        )
    return score_batch([data_source], [solution_str], [ground_truth], [extra_info])[0]
