"""Which module builds a model of each `ModelFamily`: the one dispatch the loaders and the
compile planner share, so a new family is added here once."""

from __future__ import annotations

from jaxserve.config import ModelConfig, ModelFamily
from jaxserve.model.decoder import Decoder
from jaxserve.model.gemma3 import Gemma3
from jaxserve.model.llama import Transformer

Model = Transformer | Gemma3 | Decoder

CLASSES = {ModelFamily.LLAMA: Transformer, ModelFamily.GEMMA3: Gemma3,
           ModelFamily.QWEN3: Decoder, ModelFamily.QWEN3_MOE: Decoder,
           ModelFamily.MISTRAL: Decoder, ModelFamily.MIXTRAL: Decoder, ModelFamily.PHI3: Decoder}


def model_class(cfg: ModelConfig) -> type[Transformer] | type[Gemma3] | type[Decoder]:
  """The module that builds a model of `cfg`'s family."""
  return CLASSES[cfg.family]
