"""Random ragged-step inputs for the ragged kernel tests (numpy, host side).

Each live sequence owns distinct pages, never page 0 (the engine's scratch page); page-table
entries past a sequence's last page point at page 0. Every page no live sequence owns is filled
with NaN (int8, which has none: -128, a value quantize never writes), so a kernel that reads or
writes where it should not shows it.
Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kernels_pallas import kv_quant, ragged_layout


@dataclasses.dataclass(frozen=True)
class KernelShape:
  """One kernel call's shapes (not the engine's step_args.StepShape)."""
  num_heads: int
  num_kv_heads: int
  head_dim: int
  page_size: int
  pages_per_seq: int  # W
  dtype: type = jnp.float32  # The pages'; q, k_new, v_new are float32 for 8-bit pages.
  num_layers: int = 2

  @property
  def q_dtype(self):
    return jnp.float32 if kv_quant.is_8bit(self.dtype) else self.dtype


INT8_FILLER = -128


def filler(dtype) -> float:
  """What fills the pages no sequence owns."""
  return INT8_FILLER if kv_quant.is_int8(dtype) else np.nan


def is_filler(pages) -> np.ndarray:
  pages = np.asarray(pages)
  if pages.dtype == np.int8:
    return pages == INT8_FILLER
  return np.isnan(pages.astype(np.float32))


def _random_pages(rng, shape: KernelShape, layout, num_pages: int, owned):
  """[L, P, Z, Cr] pages: random values (int8: integers and exponents -7..-5) in owned pages."""
  size = (shape.num_layers, len(owned), shape.page_size, layout.lanes)
  pages = np.full((shape.num_layers, num_pages, shape.page_size, layout.lanes),
                  filler(shape.dtype), np.float32)
  if kv_quant.is_int8(shape.dtype):
    pages[:, owned] = rng.integers(-127, 128, size)
    lo = layout.value_lanes
    pages[:, owned, :, lo:lo + 2 * shape.num_kv_heads] = rng.integers(
        -7, -4, (*size[:3], 2 * shape.num_kv_heads))
  else:
    pages[:, owned] = rng.standard_normal(size)
  pages[:, owned, :, layout.used_lanes:] = 0.0  # Padding lanes are zeros, as the cache makes them.
  return jnp.asarray(pages, shape.dtype)


def step_inputs(rng: np.random.Generator, batch, shape: KernelShape, *, num_tokens: int,
                num_seqs_max: int, layer: int = 1):
  """batch: (q_len, context) per live sequence. Returns the ragged_paged_attention arguments
  (q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens, num_seqs) as a list, with
  layer as a keyword in a dict beside it."""
  z, w = shape.page_size, shape.pages_per_seq
  q_lens = [n for n, _ in batch]
  kv_lens = [n + c for n, c in batch]
  if sum(q_lens) > num_tokens or max(kv_lens) > z * w or len(batch) > num_seqs_max:
    raise ValueError(f"batch {batch} does not fit {num_tokens} tokens, {w} pages of {z}, "
                     f"{num_seqs_max} sequences")
  used = [-(-n // z) for n in kv_lens]
  num_pages = sum(used) + 3  # Page 0 and two pages no sequence owns.
  owned = rng.permutation(np.arange(1, num_pages))[:sum(used)]
  tables = np.zeros((num_seqs_max, w), np.int32)
  tables[len(batch):] = rng.integers(0, num_pages, (num_seqs_max - len(batch), w))  # Ignored.
  start = 0
  for b, n in enumerate(used):
    tables[b, :n] = owned[start:start + n]
    start += n
  layout = ragged_layout.layout_for(shape.num_kv_heads, shape.head_dim, shape.dtype)
  pages = _random_pages(rng, shape, layout, num_pages, owned)
  cu = np.zeros(num_seqs_max + 1, np.int32)
  cu[1:len(batch) + 1] = np.cumsum(q_lens)
  cu[len(batch) + 1:] = rng.integers(0, num_tokens + 1, num_seqs_max - len(batch))  # Ignored.
  lens = np.zeros(num_seqs_max, np.int32)
  lens[:len(batch)] = kv_lens
  lens[len(batch):] = rng.integers(0, z * w + 1, num_seqs_max - len(batch))  # Ignored.
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), shape.q_dtype)
  args = [normal(num_tokens, shape.num_heads, shape.head_dim),
          normal(num_tokens, shape.num_kv_heads, shape.head_dim),
          normal(num_tokens, shape.num_kv_heads, shape.head_dim),
          pages, jnp.asarray(tables), jnp.asarray(cu),
          jnp.asarray(lens), jnp.int32(len(batch))]
  return args, {"layer": jnp.int32(layer)}


def owned_pages(page_tables, kv_lens, num_seqs: int, page_size: int) -> np.ndarray:
  """The pages the first num_seqs sequences own (host side)."""
  tables, lens = np.asarray(page_tables), np.asarray(kv_lens)
  return np.concatenate([tables[b, :-(-int(lens[b]) // page_size)] for b in range(num_seqs)]
                        + [np.zeros(0, np.int32)])


def image_reach(rng: np.random.Generator, batch, num_tokens: int) -> jnp.ndarray:
  """attend_until [T] int32 for a step of `batch` ((q_len, context) per live sequence): in each
  sequence of 3 or more new tokens a random span of them (an image) sees up to the span's last
  position; the other tokens their own; padding rows a large value (kept in bounds)."""
  until = np.full(num_tokens, 10**6, np.int32)
  at = 0
  for q_len, context in batch:
    until[at:at + q_len] = context + np.arange(q_len)
    if q_len >= 3:
      a = int(rng.integers(0, q_len - 2))
      b = int(rng.integers(a + 2, q_len + 1))
      until[at + a:at + b] = context + b - 1
    at += q_len
  return jnp.asarray(until)
