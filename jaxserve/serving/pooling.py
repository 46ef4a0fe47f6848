"""The serving core's pooling requests (`serve --task embed|rerank`): embeddings and scores
through the same accept, gateway and engine path as generation (service.py).

  prepare, on a worker: every input tokenized (or its ids checked), cut to its last
    `truncate_prompt_tokens` when asked, priced under the key's tokens per minute, one engine
    request each (SamplingParams(pooling=True, max_tokens=1): one prefill-only pooling step)
  -> rows, on the event loop: every run through Service.generate at once (its metrics, record
    and abort on a client's leaving), each run's pooled row from its last chunk.

Scores of (query, document) pairs: pair_prompts makes the prompts, scores reads their rows. The
HTTP routes (api/openai_embed.py) and the gRPC methods (api/grpc_pooling.py) share all of it.

Every error is an ApiError naming the problem, before anything is queued.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import numpy as np

from jaxserve.batching import pooled
from jaxserve.batching.request import RequestRejected
from jaxserve.config import SamplingParams, is_int, short
from jaxserve.config.pooling import Task
from jaxserve.serving.gateway import invalid
from jaxserve.serving.requests import Accepted, GenerateInput, Prompt, Run
from jaxserve.serving.service import Service

POOLING = SamplingParams(max_tokens=1, pooling=True)


def pooler(service: Service, task: Task, route: str) -> pooled.Pooler:
  """The served model's Pooler; a 400 naming the problem when it serves another task."""
  have = service.pooler
  if have is None:
    raise invalid(f"{route}: this server generates text; embeddings and scores need a pooling "
                  "model (jaxserve serve --task embed or --task rerank)")
  if task is Task.EMBED and have.task is not Task.EMBED:
    raise invalid(f"{route}: this server's model is a reranker (--task rerank): it scores "
                  "pairs (/v1/rerank, /v1/score) and makes no embeddings")
  return have


def prepare(service: Service, acc: Accepted, prompts: Sequence[Prompt],
            truncate_prompt_tokens: int | None = None, model: str = "") -> list[Run]:
  """One run per prompt (on a worker), priced under the key's tokens per minute."""
  try:
    pooled.check_inputs(prompts)
  except ValueError as e:
    raise invalid(str(e)) from e
  service.check_model(model)
  if truncate_prompt_tokens is not None and not (
      is_int(truncate_prompt_tokens) and 1 <= truncate_prompt_tokens < service.max_model_len):
    raise invalid(f"truncate_prompt_tokens must be an integer in [1, {service.max_model_len - 1}]"
                  f", got {truncate_prompt_tokens!r}")
  start = time.monotonic()
  ids = [service.prompts.encode(p, truncate=truncate_prompt_tokens is not None) for p in prompts]
  if truncate_prompt_tokens is not None:
    ids = [i[-truncate_prompt_tokens:] for i in ids]
  tokenize_s = (time.monotonic() - start) / len(prompts)
  acc.lease.reserve(sum(len(i) for i in ids), [1] * len(ids))
  runs = []
  for n, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
    try:
      request = service.runner.new_request(prompt_ids, POOLING)
    except (RequestRejected, ValueError) as e:  # Empty, or longer than the context window.
      raise invalid(f"input {n}: {e}" + ("" if truncate_prompt_tokens else
                                          " (truncate_prompt_tokens keeps its end)")) from e
    runs.append(Run(GenerateInput(prompt), request, tokenize_s, 1))
  return runs


async def rows(service: Service, acc: Accepted, runs: Sequence[Run]) -> list[np.ndarray]:
  """Each run's pooled row, in order; all run at once, and all are aborted if one fails."""
  async def one(run: Run) -> np.ndarray:
    last = None
    async for chunk in service.generate(acc, run):
      last = chunk
    return last.pooled

  async with asyncio.TaskGroup() as group:
    tasks = [group.create_task(one(run)) for run in runs]
  return [t.result() for t in tasks]


def prompts_of(value, name: str = "input") -> list[Prompt]:
  """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of those;
  each a Prompt. A 400 naming `name` for anything else."""
  if isinstance(value, str):
    return [Prompt(text=value)]
  if not isinstance(value, list):
    raise invalid(f"{name} must be a string, a list of strings or a list of token ids")
  if value and all(is_int(i) for i in value):
    return [Prompt(token_ids=value)]
  out = []
  for n, item in enumerate(value):
    if isinstance(item, str):
      out.append(Prompt(text=item))
    elif isinstance(item, list) and item and all(is_int(i) for i in item):
      out.append(Prompt(token_ids=item))
    else:
      raise invalid(f"{name}[{n}] must be a string or a non-empty list of token ids")
  return out


def pair_prompts(pooler: pooled.Pooler, pairs: Sequence[tuple[str, str]],
                 instruction: str | None = None) -> list[Prompt]:
  """The prompts that score (query, document) `pairs`: a reranker's prompt per pair; an
  embedding model's each distinct text once (scores() pairs them up again)."""
  if instruction is not None and not isinstance(instruction, str):
    raise invalid(f"instruction must be a string, got {short(instruction)}")
  if pooler.task is Task.RERANK:
    return [Prompt(text=pooled.rerank_prompt(q, d, instruction)) for q, d in pairs]
  return [Prompt(text=t) for t in _texts(pairs)]


def scores(pooler: pooled.Pooler, pairs: Sequence[tuple[str, str]],
           rows: Sequence[np.ndarray]) -> list[float]:
  """Each pair's score from the rows of pair_prompts' prompts, in order."""
  if pooler.task is Task.RERANK:
    return [pooler.score(r) for r in rows]
  vec = dict(zip(_texts(pairs), (pooler.embedding(r) for r in rows)))
  return [pooled.cosine(vec[q], vec[d]) for q, d in pairs]


def _texts(pairs: Sequence[tuple[str, str]]) -> list[str]:
  return list(dict.fromkeys(t for pair in pairs for t in pair))
