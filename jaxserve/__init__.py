"""jaxserve: a small, fast JAX/XLA inference engine for decoder-only LLMs.

The configs import at once; `LLM` (the device side: JAX, the model, the engine) only when first
used (PEP 562), so the host side (scheduler, server, client, planner) imports without JAX.
"""

from jaxserve.config import (
  Constraint,
  EngineConfig,
  LoRARequest,
  ModelConfig,
  SamplingParams,
  SchedulerConfig,
  SpeculativeConfig,
)

__all__ = ["LLM", "SamplingParams", "Constraint", "EngineConfig", "LoRARequest", "ModelConfig",
           "SchedulerConfig", "SpeculativeConfig"]


def __getattr__(name: str):
  if name == "LLM":
    from jaxserve.llm import LLM
    return LLM
  raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
