"""How a pooling engine (`serve --task embed|rerank`) turns a prompt's hidden states into one
vector: which positions it pools, and for a reranker which logits it keeps."""

from __future__ import annotations

import dataclasses
import enum

from jaxserve.config.checks import is_int


class PoolingMode(enum.Enum):
  """Which positions of the final-normed last layer a prompt's vector is made of."""

  LAST = "last"  # The last prompt token's (Qwen3-Embedding, decoder rerankers).
  MEAN = "mean"  # The mean over every prompt token (sentence-transformers' default).
  CLS = "cls"  # The first token's.

  @property
  def needs_every_position(self) -> bool:
    """A cached prefix's positions are never computed again: a pooler that reads them cannot
    reuse the prefix cache."""
    return self is not PoolingMode.LAST


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
  """The pooling steps an engine compiles (EngineConfig.pooling). `logit_ids` set (a reranker
  such as Qwen3-Reranker: its "no" and "yes" tokens) makes each pooled row the head's logits at
  those ids in place of the hidden state; the front end turns them into a score."""

  mode: PoolingMode = PoolingMode.LAST
  logit_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if not isinstance(self.mode, PoolingMode):
      if self.mode not in {m.value for m in PoolingMode}:
        raise ValueError(f"pooling mode must be one of {[m.value for m in PoolingMode]}, got "
                         f"{self.mode!r}")
      object.__setattr__(self, "mode", PoolingMode(self.mode))
    if not all(is_int(i) and i >= 0 for i in self.logit_ids):
      raise ValueError(f"PoolingConfig.logit_ids must be token ids, got {self.logit_ids!r}")
    object.__setattr__(self, "logit_ids", tuple(self.logit_ids))
    if self.logit_ids and self.mode is not PoolingMode.LAST:
      raise ValueError("a reranker's logits (PoolingConfig.logit_ids) are read at the last "
                       f"token: pooling mode {self.mode.value!r} cannot have them")


class Task(enum.Enum):
  """What a server or an LLM is for (`serve --task`, `LLM(task=...)`), as vLLM's tasks."""

  GENERATE = "generate"
  EMBED = "embed"  # /v1/embeddings, LLM.embed; /v1/score by cosine similarity.
  RERANK = "rerank"  # /v1/rerank and /v1/score, LLM.score: a reranker's yes/no probability.
