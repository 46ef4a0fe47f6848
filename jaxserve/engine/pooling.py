"""Pooling: one vector per prompt from the final-normed last layer, for embeddings and scores.

A pooling step (batching.plan.StepKind.POOLING) is prefill only. The host packs, for each prefill
sequence, its weight on each packed row (`pool_weights`: one-hot at the prompt's last or first
row, or 1 / n at each of its n rows for the mean), so one weighted sum serves every pooling mode
and no mode is a program of its own: a prompt cut into chunks sums its chunks' shares on the
host. A reranker (PoolingConfig.logit_ids) keeps the head's logits at its label tokens in place
of the hidden state. Shape letters: the key in jaxserve/model/__init__.py (C: the logit ids).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batching.plan import PrefillChunk
from jaxserve.config import PoolingConfig, PoolingMode


def pooling_args(pooling: PoolingConfig | None, chunks: Sequence[PrefillChunk], Bp: int,
                 Tp: int) -> dict[str, np.ndarray]:
  """pool_weights [Bp, Tp] and pool_ids [C] (engine.step_args.StepArgs) of a pooling step of
  `chunks`; an embedding model's ids are empty (C = 0: its pooled rows are D wide)."""
  if pooling is None:
    raise ValueError("a pooling step on an engine without pooling (EngineConfig.pooling)")
  ids = np.asarray(pooling.logit_ids, np.int32).reshape(-1)
  return dict(pool_weights=pool_weights(chunks, pooling.mode, Bp, Tp), pool_ids=ids)


def pool_weights(chunks: Sequence[PrefillChunk], mode: PoolingMode, Bp: int,
                 Tp: int) -> np.ndarray:
  """[Bp, Tp] float32: chunk j's weight on each packed row, so that summed over its chunks a
  request's vector is its pooled one: LAST one at the prompt's last row (in its last chunk),
  CLS one at its first (a chunk from position 0), MEAN 1 / pool_len at each of its rows."""
  weights = np.zeros((Bp, Tp), np.float32)
  at = 0
  for j, ch in enumerate(chunks):
    n = len(ch.token_ids)
    if mode is PoolingMode.MEAN:
      weights[j, at:at + n] = 1 / ch.pool_len
    elif mode is PoolingMode.CLS and ch.start_pos == 0:
      weights[j, at] = 1
    elif mode is PoolingMode.LAST and ch.is_last:
      weights[j, at + n - 1] = 1
    at += n
  return weights


def pool(model, hidden_TD, weights_BpTp, ids_C) -> jax.Array:
  """hidden [Tp, D] the last layer's output at the prefill rows -> [Bp, D] float32, each
  sequence's weighted sum of the final-normed rows; or, with C > 0 logit ids (a reranker),
  [Bp, C] the head's logits at ids_C of the weighted sum of the raw rows (one-hot: LAST)."""
  sum_rows = lambda x_TD: jnp.einsum("BT,TD->BD", weights_BpTp, x_TD.astype(jnp.float32),
                                     precision=jax.lax.Precision.HIGHEST)  # Exact one-hot rows.
  if ids_C.shape[0]:  # A shape: each engine compiles one of the two.
    return model.head(sum_rows(hidden_TD).astype(hidden_TD.dtype))[:, ids_C]  # [Bp, C]
  return sum_rows(model.normed(hidden_TD))  # [Bp, D]
