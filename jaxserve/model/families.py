"""Which module builds a model of each `ModelFamily`: the one dispatch the loaders and the
compile planner share, so a new family is added here once."""

from __future__ import annotations

from jaxserve.config import ModelConfig, ModelFamily
from jaxserve.model.gemma3 import Gemma3
from jaxserve.model.llama import Transformer

Model = Transformer | Gemma3

# Every family but Gemma 3 is the Llama block with its config's switches (llama.DecoderLayer).
CLASSES = {family: Transformer for family in ModelFamily} | {ModelFamily.GEMMA3: Gemma3}


def model_class(cfg: ModelConfig) -> type[Transformer] | type[Gemma3]:
  """The module that builds a model of `cfg`'s family."""
  return CLASSES[cfg.family]
