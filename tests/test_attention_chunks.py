"""The jnp attention's online softmax over the context in chunks (model/attention.py) against a
dense softmax worked out in numpy: contexts of several chunks, windows, idle rows, every layout;
a query's output the same bit for bit whatever else its step holds; memory that follows the
chunk, not the page-table width; and a one-chunk table's gradient under jit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig, KVLayout, ModelConfig
from jaxserve.engine.kv_spec import create_pool, slot_page_tables
from jaxserve.model import attention
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import KVCache

Z, K, G, H = 16, 2, 3, 8  # page size, KV heads, query heads per KV head, head dim
CFG = ModelConfig(name="t", vocab_size=32, dim=K * G * H, num_layers=1, num_heads=K * G,
                  num_kv_heads=K, head_dim=H, hidden_dim=8)


def _cache(layout: KVLayout, num_slots: int, max_len: int, rng) -> tuple[KVCache, np.ndarray]:
  """A cache of random K/V at every position, and [num_slots, W] page tables (scattered pages for
  the paged layouts)."""
  W = max_len // Z
  engine = EngineConfig(num_slots=num_slots, page_size=Z, num_pages=num_slots * W + 1,
                        max_model_len=max_len, kv_layout=layout)
  cache = create_pool(CFG, engine)
  tables = slot_page_tables(engine)
  if tables is None:
    tables = (1 + rng.permutation(num_slots * W)).reshape(num_slots, W).astype(np.int32)
  k, v = rng.normal(size=(2, 1, num_slots * W * Z, K, H)).astype(np.float32)
  slots = (tables[:, :, None] * Z + np.arange(Z)).reshape(1, -1)  # [1, S * W * Z] cache slots
  return cache.write(0, jnp.asarray(slots), jnp.asarray(k), jnp.asarray(v)), tables


def _dense(q, cache, table, kv_len, pos, window):
  """One query's heads [N, H] against its sequence's positions, in float64."""
  k, v = (np.asarray(x[0], np.float64) for x in cache.gather(0, jnp.asarray(table[None])))
  seen = (np.arange(k.shape[0]) <= pos) & (np.arange(k.shape[0]) < kv_len)
  if window is not None:
    seen &= np.arange(k.shape[0]) > pos - window
  if not seen.any():
    return np.zeros((K * G, H))
  qh = np.asarray(q, np.float64).reshape(K, G, H)
  s = np.einsum("KGH,SKH->KGS", qh, k) * H ** -0.5
  s = np.where(seen, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("KGS,SKH->KGH", p, v).reshape(K * G, H)


def _meta(rows_of, tables, kv_lens, positions, num_decode_rows):
  """Metadata of decode rows (one token each) then blocks: rows_of[b] the packed rows of block b
  of sequence num_decode_rows + b."""
  T = len(positions)
  Tb = max(len(r) for r in rows_of) if rows_of else 1
  block_rows = np.full((len(rows_of), Tb), T, np.int32)
  for b, r in enumerate(rows_of):
    block_rows[b, :len(r)] = r
  block_seq = np.arange(len(rows_of), dtype=np.int32) + num_decode_rows
  return AttentionMetadata(
      positions=jnp.asarray(positions, jnp.int32)[None], cache_index=jnp.zeros((1, T), jnp.int32),
      page_tables=jnp.asarray(tables), kv_lens=jnp.asarray(kv_lens, jnp.int32),
      cu_q_lens=jnp.zeros(len(kv_lens) + 1, jnp.int32), sample_rows=jnp.zeros(len(kv_lens)),
      block_rows=jnp.asarray(block_rows), block_seq=jnp.asarray(block_seq),
      num_decode_rows=num_decode_rows)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("window", [None, 100])
def test_chunked_online_softmax_equals_the_dense_softmax(layout, window):
  """Three decode rows (700 positions: three chunks; 1; an idle row) and a prefill sequence of
  two query blocks ending at position 599, against numpy."""
  rng = np.random.default_rng(0)
  cache, tables = _cache(layout, 4, 768, rng)
  positions = [699, 0, 0] + list(range(580, 600))
  kv_lens = [700, 1, 0, 600]
  q = rng.normal(size=(1, len(positions), K * G, H)).astype(np.float32)
  meta = _meta([list(range(3, 19)), list(range(19, 23))], tables[[0, 1, 2, 3]], kv_lens,
               positions, 3)
  out = np.asarray(jax.jit(attention.attend_reference, static_argnums=4)(
      jnp.asarray(q), cache, 0, meta, window))[0]
  seq = [0, 1, 2] + [3] * 20
  for t, (s, pos) in enumerate(zip(seq, positions)):
    want = _dense(q[0, t], cache, tables[s], kv_lens[s], pos, window)
    np.testing.assert_allclose(out[t], want, atol=2e-5, err_msg=f"row {t}")
  assert not out[2].any()  # The idle row: zeros, not NaN.


def test_a_query_gives_the_same_bits_whatever_its_step_holds():
  """A decode row over 300 positions alone, and beside a sequence of 2,000 (more chunks in the
  step's loop, a wider table): the same output bit for bit."""
  rng = np.random.default_rng(1)
  cache, tables = _cache(KVLayout.PAGED_TOKEN_MAJOR, 2, 2048, rng)
  q = rng.normal(size=(1, 2, K * G, H)).astype(np.float32)
  run = jax.jit(attention.attend_reference)
  alone = run(jnp.asarray(q[:, :1]), cache, 0, _meta([], tables[:1, :32], [300], [299], 1))
  beside = run(jnp.asarray(q), cache, 0, _meta([], tables, [300, 2000], [299, 1999], 2))
  np.testing.assert_array_equal(np.asarray(alone)[0, 0], np.asarray(beside)[0, 0])


def test_attention_memory_follows_the_chunk_not_the_table_width():
  """A prefill step of 64 query rows over a 64-page table and over a 1,024-page one: the
  compiled step's temporary buffers stay the same size (a whole-table gather or score matrix
  would grow them 16-fold)."""
  rng = np.random.default_rng(2)

  def temp_bytes(pages):
    cache, tables = _cache(KVLayout.PAGED_TOKEN_MAJOR, 1, pages * Z, rng)
    meta = _meta([list(range(i, i + 16)) for i in range(0, 64, 16)], tables[[0] * 4],
                 [pages * Z] * 4, list(range(64)), 0)
    meta = dataclasses.replace(meta, block_seq=jnp.zeros(4, jnp.int32))
    q = jnp.zeros((1, 64, K * G, H))
    compiled = jax.jit(attention.attend_reference).lower(q, cache, 0, meta).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(1024) <= 1.25 * temp_bytes(64)


def test_a_one_chunk_table_differentiates_as_the_dense_softmax():
  """A prefill of 40 tokens over a table that one chunk holds (a trainer's forward, as
  scripts/rl.py runs it): reverse-mode autodiff works, and the gradient in q of a random
  projection of the output is the dense jnp softmax's."""
  rng = np.random.default_rng(3)
  cache, tables = _cache(KVLayout.PAGED_TOKEN_MAJOR, 1, 64, rng)
  n = 40
  meta = _meta([list(range(n))], tables, [n], list(range(n)), 0)
  q = jnp.asarray(rng.normal(size=(1, n, K * G, H)).astype(np.float32))
  w = jnp.asarray(rng.normal(size=(n, K * G, H)).astype(np.float32))
  k, v = (x[0, :n] for x in cache.gather(0, jnp.asarray(tables)))  # [n, K, H]

  def dense(q):
    s = jnp.einsum("TKGH,SKH->KGTS", q[0].reshape(n, K, G, H), k) * H ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("KGTS,SKH->TKGH", jax.nn.softmax(s, -1), v).reshape(n, K * G, H)

  # Under jit, as a train step runs it: the lengths are traced, so no bound can be read off them.
  loss = lambda q, meta: jnp.sum(w * attention.attend_reference(q, cache, 0, meta)[0])
  got = jax.jit(jax.grad(loss))(q, meta)
  want = jax.grad(lambda q: jnp.sum(w * dense(q)))(q)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
