"""Rollout: the engine interface (base.py) and the built-in transformers engine (hf_engine.py)."""

from trainer.rollout.base import FinishReason, Rollout, RolloutEngine, SamplingParams
from trainer.rollout.hf_engine import HFRolloutEngine

__all__ = ["FinishReason", "HFRolloutEngine", "Rollout", "RolloutEngine", "SamplingParams"]
