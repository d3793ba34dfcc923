"""Is the Hugging Face hub reachable? One quick probe before a hub load.

Without it a machine offline waits through huggingface_hub's retries (25-50 s of doubled warnings) and
ends in a long traceback. With it, a model or dataset already in the local cache loads offline, and one
that is not fails at once with one line naming the offline alternative.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """False when offline mode is asked for (HF_HUB_OFFLINE=1, ...) or a TCP connection to the hub
    (HF_ENDPOINT, default huggingface.co:443) cannot be opened within `timeout_s`."""
    if any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in OFFLINE_VARIABLES):
        return False
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout=timeout_s).close()
        return True
    except OSError:
        return False
