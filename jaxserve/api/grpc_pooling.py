"""The gRPC methods of a pooling model (`serve --task embed|rerank`), Embed and Score, on the
serving core's path that /v1/embeddings and /v1/score take (serving/pooling.py):

  accept: the API key and its requests per minute, as Generate's
  -> plan, on a worker: the request checked (the server's task, dimensions, inputs), every
     prompt tokenized and priced under the key's tokens per minute, one engine request each
  -> pooling.rows: every run through the engine at once
  -> the response, on a worker: each input's vector (Embed) or each document's score (Score).

A gateway `ApiError` is the status code of the same name, through grpc_api's abort (so a pooling
call to a generation server is INVALID_ARGUMENT naming `--task`, as HTTP's 400).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

import grpc
from absl import logging

from jaxserve.api.grpc_wire import bearer_token, decoded, decoder
from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.config.pooling import Task
from jaxserve.serving import pooling
from jaxserve.serving.gateway import ApiError, Status, invalid
from jaxserve.serving.requests import Accepted, Prompt, Run
from jaxserve.serving.service import Service

# A plan: the request's engine runs, and what makes the response of their pooled rows.
Plan = tuple[list[Run], Callable[[list], Any]]


class Pooling:
  """Embed and Score, for grpc_api.Servicer: `host` gives the current service, `abort` ends a
  call with an ApiError's status code (and counts it)."""

  def __init__(self, host: Any, abort: Callable[[Any, ApiError], Awaitable[None]]):
    self._host, self._abort = host, abort

  def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
    return {
        "Embed": grpc.unary_unary_rpc_method_handler(
            self.Embed, decoder(pb.EmbedRequest), pb.EmbedResponse.SerializeToString),
        "Score": grpc.unary_unary_rpc_method_handler(
            self.Score, decoder(pb.ScoreRequest), pb.ScoreResponse.SerializeToString),
    }

  async def Embed(self, request: pb.EmbedRequest,
                  context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
    return await self._answer("Embed", _embed_plan, request, context)

  async def Score(self, request: pb.ScoreRequest,
                  context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
    return await self._answer("Score", _score_plan, request, context)

  async def _answer(self, name: str, plan: Callable[..., Plan], request: Any,
                    context: grpc.aio.ServicerContext) -> Any:
    try:
      service = self._host.current_service()
      async with service.accept(bearer_token(context.invocation_metadata())) as acc:
        runs, respond = await acc.work(plan, service, acc, request)
        rows = await pooling.rows(service, acc, runs)
        return await acc.work(respond, rows)
    except ApiError as e:
      await self._abort(context, e)
    except Exception:  # pylint: disable=broad-except  (a bug: report it, keep serving)
      logging.exception("%s failed", name)
      await self._abort(context, ApiError(Status.INTERNAL, "internal error; see the server log"))


def _embed_plan(service: Service, acc: Accepted, request: Any) -> Plan:
  request = decoded(request)
  pooler = pooling.pooler(service, Task.EMBED, "Embed")
  dimensions = _optional(request, "dimensions")
  try:
    pooler.check_dimensions(dimensions)
  except ValueError as e:
    raise invalid(str(e)) from e
  normalize = _optional(request, "normalize")
  prompts = [_prompt(item, n) for n, item in enumerate(request.inputs)]
  runs = pooling.prepare(service, acc, prompts, _optional(request, "truncate_prompt_tokens"),
                         request.model)

  def respond(rows: list) -> pb.EmbedResponse:
    vecs = [pooler.embedding(r, dimensions, normalize) for r in rows]
    return pb.EmbedResponse(embeddings=[pb.Embedding(values=v.tolist()) for v in vecs],
                            usage=_usage(runs), model=service.model_name)
  return runs, respond


def _score_plan(service: Service, acc: Accepted, request: Any) -> Plan:
  request = decoded(request)
  pooler = pooling.pooler(service, Task.RERANK, "Score")  # Either kind of model scores.
  if not request.documents:
    raise invalid("documents is empty: give at least one text")
  pairs = [(request.query, d) for d in request.documents]
  prompts = pooling.pair_prompts(pooler, pairs, _optional(request, "instruction"))
  runs = pooling.prepare(service, acc, prompts, _optional(request, "truncate_prompt_tokens"),
                         request.model)

  def respond(rows: list) -> pb.ScoreResponse:
    return pb.ScoreResponse(scores=pooling.scores(pooler, pairs, rows), usage=_usage(runs),
                            model=service.model_name)
  return runs, respond


def _prompt(item: pb.EmbedInput, n: int) -> Prompt:
  kind = item.WhichOneof("input")
  if kind == "text":
    return Prompt(text=item.text)
  if kind == "token_ids" and item.token_ids.ids:
    return Prompt(token_ids=list(item.token_ids.ids))
  raise invalid(f"inputs[{n}] must be a text or a non-empty list of token ids")


def _optional(request: Any, field: str) -> Any:
  return getattr(request, field) if request.HasField(field) else None


def _usage(runs: Sequence[Run]) -> pb.Usage:
  return pb.Usage(prompt_tokens=sum(run.request.num_prompt_tokens for run in runs))
