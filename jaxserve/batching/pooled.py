"""What the front ends make of a pooling engine's rows (RequestOutput.pooled): an embedding
(Matryoshka-truncated, L2-normalized as sentence-transformers' Normalize does), a reranker's
score (the softmax of its "no" and "yes" logits at "yes", as Qwen3-Reranker's own code), and the
reranker's prompt. The offline LLM and the servers share it. No jax."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxserve.config.pooling import Task

# Qwen3-Reranker's prompt (its model card, and vLLM's example): a system turn that asks for
# "yes" or "no", the instruction, query and document in the user turn, an empty thinking block.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
                 "the Query and the Instruct provided. Note that the answer can only be \"yes\" "
                 "or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
MAX_INPUTS = 2048  # Inputs in one request (OpenAI's limit for embeddings).


@dataclasses.dataclass(frozen=True)
class Pooler:
  """A pooling model's post-processing: `dim` its hidden size (an embedding's full length),
  `normalize` whether its embeddings are L2-normalized (sentence-transformers' Normalize module),
  `dimensions` the shorter lengths it was trained to be cut to (Matryoshka; () none, None any)."""

  task: Task
  dim: int
  normalize: bool = True
  dimensions: tuple[int, ...] | None = ()

  def check_dimensions(self, dimensions: int | None) -> None:
    """Raises ValueError naming the problem when `dimensions` is not a length this model's
    embeddings may be cut to."""
    if dimensions is None:
      return
    if self.task is not Task.EMBED:
      raise ValueError("dimensions: only an embedding model's vectors can be cut")
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
      raise ValueError(f"dimensions must be an integer, got {dimensions!r}")
    ok = dimensions == self.dim or (1 <= dimensions <= self.dim and (
        self.dimensions is None or dimensions in self.dimensions))
    if not ok:
      allowed = (f"1 to {self.dim}" if self.dimensions is None else
                 ", ".join(str(d) for d in sorted({*self.dimensions, self.dim})))
      raise ValueError(f"dimensions {dimensions}: this model's embeddings can be {allowed} long"
                       + ("" if self.dimensions else " (it was not trained to be cut: no "
                          "Matryoshka dimensions)"))

  def embedding(self, row: np.ndarray, dimensions: int | None = None,
                normalize: bool | None = None) -> np.ndarray:
    """float32 [dimensions or D]: the pooled row cut to `dimensions` (checked), then
    L2-normalized when the model's embeddings are (or `normalize` says so)."""
    self.check_dimensions(dimensions)
    vec = np.asarray(row, np.float32)[:dimensions or self.dim]
    if self.normalize if normalize is None else normalize:
      vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec

  def score(self, row: np.ndarray) -> float:
    """A reranker's relevance: the probability of "yes" against "no" (row: their logits, in
    the order PoolingConfig.logit_ids gives, "no" first)."""
    no, yes = (float(x) for x in row[:2])
    return float(1 / (1 + np.exp(no - yes)))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
  """Cosine similarity: an embedding model's score of a query against a document."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
  """Qwen3-Reranker's prompt for one (query, document) pair."""
  return (f"{RERANK_PREFIX}<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
          f"<Document>: {document}{RERANK_SUFFIX}")


def check_inputs(inputs: Sequence, name: str = "input") -> None:
  """Raises ValueError for an empty list of inputs, or one longer than MAX_INPUTS."""
  if not len(inputs):
    raise ValueError(f"{name} is empty: give at least one text")
  if len(inputs) > MAX_INPUTS:
    raise ValueError(f"{name}: at most {MAX_INPUTS} inputs in one request, got {len(inputs):,}")
