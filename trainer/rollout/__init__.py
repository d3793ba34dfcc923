"""Rollout: the records every engine takes and gives (base.py), the SGLang-API protocol every replica
speaks (protocol.py), the built-in fast engine (builtin/) and its server (server.py), the replica client
and pool (client.py, pool.py), the trainer-side manager and its builder (manager.py), the SGLang launcher
(launcher.py) and the reference transformers engine (hf_engine.py).
"""

from trainer.rollout.base import FinishReason, Rollout, SamplingParams

__all__ = ["FinishReason", "Rollout", "SamplingParams"]
