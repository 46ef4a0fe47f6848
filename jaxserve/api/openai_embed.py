"""The pooling routes, in OpenAI's and vLLM's shapes (a server of `--task embed` or `rerank`):

  POST /v1/embeddings  {"input": str | [str] | [ids] | [[ids]], "model", "encoding_format":
                       "float" | "base64", "dimensions", "truncate_prompt_tokens"}
                       -> {"object": "list", "data": [{"object": "embedding", "index",
                       "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}
  POST /v1/rerank      {"query", "documents": [str], "top_n", "return_documents", "instruction"}
                       -> {"id", "model", "results": [{"index", "relevance_score",
                       "document": {"text"}}] best first, "usage": {"total_tokens"}}
  POST /v1/score       {"text_1": str | [str], "text_2": str | [str], "instruction"} -> {"id",
                       "object": "list", "data": [{"index", "object": "score", "score"}], ...}

A reranker's score is its "yes" probability on its prompt (batching/pooled.py); an embedding
model's the cosine similarity of the two texts' embeddings. base64 is the float32 vector's
little-endian bytes, as OpenAI's client decodes it. Every function raises only `ApiError`.
"""

from __future__ import annotations

import base64
import secrets
import time
from typing import Any, Mapping

import numpy as np

from jaxserve.api.openai_request import parse_body
from jaxserve.config import short
from jaxserve.config.pooling import Task
from jaxserve.serving import pooling
from jaxserve.serving.gateway import invalid
from jaxserve.serving.requests import Accepted
from jaxserve.serving.service import Service
from jaxserve.serving.work_pool import dumps

_FIELDS = {
    "/v1/embeddings": {"model", "input", "encoding_format", "dimensions", "user",
                       "truncate_prompt_tokens"},
    "/v1/rerank": {"model", "query", "documents", "top_n", "return_documents", "instruction",
                   "truncate_prompt_tokens"},
    "/v1/score": {"model", "text_1", "text_2", "instruction", "truncate_prompt_tokens"},
}


async def answer(route: str, service: Service, acc: Accepted, body: bytes) -> bytes:
  """The whole answer of one pooling route: parsed and prepared on a worker, run through the
  engine, formatted on a worker."""
  plan = await acc.work(_plan, route, service, acc, body)
  rows = await pooling.rows(service, acc, plan["runs"])
  return await acc.work(_format, route, service, plan, rows)


def _plan(route: str, service: Service, acc: Accepted, body: bytes) -> dict[str, Any]:
  fields = _known(parse_body(body), route)
  task = Task.EMBED if route == "/v1/embeddings" else Task.RERANK
  pooler = pooling.pooler(service, task, route)
  if route == "/v1/embeddings":
    prompts = pooling.prompts_of(fields.get("input"))
    _check_format(fields)
    try:
      pooler.check_dimensions(fields.get("dimensions"))
    except ValueError as e:
      raise invalid(str(e)) from e
    pairs = None
  else:
    pairs = _pairs(route, fields)
    prompts = pooling.pair_prompts(pooler, pairs, fields.get("instruction"))
  runs = pooling.prepare(service, acc, prompts, fields.get("truncate_prompt_tokens"),
                         fields.get("model", ""))
  return dict(fields=fields, runs=runs, pairs=pairs, pooler=pooler)


def _pairs(route: str, fields: Mapping[str, Any]) -> list[tuple[str, str]]:
  """(query, document) pairs: /v1/rerank's query against each document; /v1/score's text_1
  against each text_2 (one text_1), or pairwise (lists of one length)."""
  if route == "/v1/rerank":
    first, second = [fields.get("query")], fields.get("documents")
    names = ("query", "documents")
  else:
    first, second, names = fields.get("text_1"), fields.get("text_2"), ("text_1", "text_2")
  first = [first] if isinstance(first, str) else first
  second = [second] if isinstance(second, str) and route == "/v1/score" else second
  for name, texts in zip(names, (first, second)):
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
      raise invalid(f"{name} must be {'a string' if name == 'query' else 'a list of strings'}"
                    f", got {short(texts)}")
  if not second:
    raise invalid(f"{names[1]} is empty: give at least one text")
  if len(first) == 1:
    return [(first[0], s) for s in second]
  if len(first) != len(second):
    raise invalid(f"{names[0]} ({len(first)} texts) and {names[1]} ({len(second)}) must be one "
                  "text against many, or lists of one length")
  return list(zip(first, second))


def _format(route: str, service: Service, plan: dict[str, Any], rows) -> bytes:
  fields, pooler = plan["fields"], plan["pooler"]
  num_tokens = sum(run.request.num_prompt_tokens for run in plan["runs"])
  usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
  if route == "/v1/embeddings":
    vecs = [pooler.embedding(r, fields.get("dimensions")) for r in rows]
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, fields)}
            for i, v in enumerate(vecs)]
    return dumps({"object": "list", "data": data, "model": service.model_name, "usage": usage})
  scores = pooling.scores(pooler, plan["pairs"], rows)
  head = {"id": f"{route[4:]}-{secrets.token_hex(8)}", "model": service.model_name,
          "usage": usage}
  if route == "/v1/score":
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return dumps({**head, "object": "list", "created": int(time.time()), "data": data})
  results = [{"index": i, "relevance_score": s} for i, s in enumerate(scores)]
  if fields.get("return_documents", True):
    for r, (_, doc) in zip(results, plan["pairs"]):
      r["document"] = {"text": doc}
  results.sort(key=lambda r: -r["relevance_score"])
  return dumps({**head, "results": results[:fields.get("top_n") or len(results)]})


def _encoded(vec: np.ndarray, fields: Mapping[str, Any]):
  if fields.get("encoding_format", "float") == "base64":
    return base64.b64encode(vec.astype("<f4").tobytes()).decode()
  return vec.tolist()


def _check_format(fields: Mapping[str, Any]) -> None:
  if fields.get("encoding_format", "float") not in ("float", "base64"):
    raise invalid(f"encoding_format must be \"float\" or \"base64\", got "
                  f"{short(fields['encoding_format'])}")


def _known(body: Mapping[str, Any], route: str) -> dict[str, Any]:
  body = {k: v for k, v in body.items() if v is not None}
  unknown = sorted(set(body) - _FIELDS[route])
  if unknown:
    raise invalid(f"{route} does not take {', '.join(short(k, 40) for k in unknown[:8])}; "
                  f"its fields are {', '.join(sorted(_FIELDS[route]))}")
  top_n = body.get("top_n")
  if top_n is not None and not (isinstance(top_n, int) and not isinstance(top_n, bool)
                                and top_n >= 0):
    raise invalid(f"top_n must be an integer >= 0, got {short(top_n)}")
  return body
