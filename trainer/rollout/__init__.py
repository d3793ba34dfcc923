"""Rollout: the engine interface (base.py), the SGLang-API protocol every replica speaks (protocol.py),
the built-in fast engine (builtin/) and its server (server.py), the replica client and pool (client.py,
pool.py), the trainer-side manager (manager.py), the SGLang launcher (launcher.py), the reference
transformers engine (hf_engine.py) and the rollout-vs-trainer logprob gap metric (metrics.py).
"""

from trainer.rollout.base import FinishReason, Rollout, RolloutEngine, SamplingParams
from trainer.rollout.hf_engine import HFRolloutEngine

__all__ = ["FinishReason", "HFRolloutEngine", "Rollout", "RolloutEngine", "SamplingParams"]
