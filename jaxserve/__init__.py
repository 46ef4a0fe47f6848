"""jaxserve: a small, fast JAX/XLA inference engine for decoder-only LLMs."""

from jaxserve.config import EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from jaxserve.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "ModelConfig", "SchedulerConfig"]
