"""Random paged-attention inputs for the kernel tests and the benchmark (numpy, host side).

Each sequence gets its own distinct pages, never page 0 (the engine's scratch page); page-table
entries past a sequence's last page point at page 0, as the engine leaves them.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PagedShape:
  num_heads: int
  num_kv_heads: int
  head_dim: int
  page_size: int
  pages_per_seq: int  # Page-table width W.
  dtype: type = jnp.float32

  @property
  def max_len(self) -> int:
    return self.page_size * self.pages_per_seq


def page_tables(rng: np.random.Generator, kv_lens, shape: PagedShape) -> np.ndarray:
  """[B, W] int32: sequence b's first cdiv(kv_lens[b], Z) entries are distinct pages >= 1."""
  used = [-(-int(n) // shape.page_size) for n in kv_lens]
  pages = rng.permutation(np.arange(1, sum(used) + 1))
  tables = np.zeros((len(kv_lens), shape.pages_per_seq), np.int32)
  start = 0
  for b, n in enumerate(used):
    tables[b, :n] = pages[start:start + n]
    start += n
  return tables


def kv_pages(rng: np.random.Generator, num_pages: int, shape: PagedShape, scratch_value=1e3):
  """K and V [P, Z, K, H]; page 0 (scratch) holds a large value that must never reach an
  output: a kernel that reads it where it should not shows up as a large error."""
  size = (num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
  k, v = rng.standard_normal(size), rng.standard_normal(size)
  k[0] = v[0] = scratch_value
  return jnp.asarray(k, shape.dtype), jnp.asarray(v, shape.dtype)


def decode_inputs(rng: np.random.Generator, lengths, shape: PagedShape, num_pages=None):
  """(q, k_pages, v_pages, page_tables, lengths) for paged_decode_attention."""
  tables = page_tables(rng, lengths, shape)
  num_pages = num_pages or int(tables.max()) + 1
  k, v = kv_pages(rng, num_pages, shape)
  q = rng.standard_normal((len(lengths), shape.num_heads, shape.head_dim))
  return (jnp.asarray(q, shape.dtype), k, v, jnp.asarray(tables),
          jnp.asarray(lengths, jnp.int32))


def prefill_inputs(rng: np.random.Generator, q_lens, context_lens, num_tokens: int,
                   shape: PagedShape, num_pages=None):
  """(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens) for ragged_prefill_attention:
  sequence s has context_lens[s] cached positions and q_lens[s] new tokens, packed into
  num_tokens rows (the rest padding)."""
  kv_lens = [c + n for c, n in zip(context_lens, q_lens)]
  cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  if cu_q_lens[-1] > num_tokens:
    raise ValueError(f"{cu_q_lens[-1]} new tokens do not fit in num_tokens={num_tokens}")
  tables = page_tables(rng, kv_lens, shape)
  num_pages = num_pages or int(tables.max()) + 1
  k, v = kv_pages(rng, num_pages, shape)
  q = rng.standard_normal((num_tokens, shape.num_heads, shape.head_dim))
  return (jnp.asarray(q, shape.dtype), k, v, jnp.asarray(tables), jnp.asarray(cu_q_lens),
          jnp.asarray(kv_lens, jnp.int32))
