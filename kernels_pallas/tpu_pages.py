"""What the two TPU kernels share: lane windows for the KV heads, and the page DMAs.

The kernels see each page as one [Z, K * H] slab ([P, Z, K, H] reshaped, a free view), so one DMA
moves a whole page and the VMEM block's last two dims are the array's own (TPU tiling rule:
(8, 128)-divisible or full). Picking KV head h out of the K * H lanes would need an unaligned lane
slice when H is not a multiple of 128 (head_dim 64), which Mosaic may reject. So each head reads a
128-aligned lane *window* [lo, hi) that covers its H lanes, and Q is laid out in the same window
with zeros on the neighbours' lanes: the window's extra lanes then add exactly 0 to QK^T, and the
output's extra lanes (other heads' PV) are dropped by the wrapper. For H a multiple of 128 the
window is the head itself; for H = 64 it costs 2x MXU work on a memory-bound kernel.
Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128


def head_windows(num_kv_heads: int, head_dim: int) -> tuple[tuple[int, int], ...]:
  """For each KV head, the 128-aligned lane range [lo, hi) of a page row that covers it."""
  width = num_kv_heads * head_dim
  windows = []
  for h in range(num_kv_heads):
    lo = (h * head_dim) // LANES * LANES
    hi = min(width, -(-(h + 1) * head_dim // LANES) * LANES)
    windows.append((lo, hi))
  return tuple(windows)


def window_width(windows) -> int:
  return max(hi - lo for lo, hi in windows)


def pack_heads(q_XKGD: jax.Array, windows) -> jax.Array:
  """[A, K, G, H] -> [A, K, G, E]: head h's H values at lane h * H - lo of its window, zeros
  elsewhere."""
  head_dim = q_XKGD.shape[-1]
  e = window_width(windows)
  heads = []
  for h, (lo, _) in enumerate(windows):
    offset = h * head_dim - lo
    lanes = (offset, e - offset - head_dim)
    heads.append(jnp.pad(q_XKGD[:, h], ((0, 0), (0, 0), lanes)))  # [A, G, E]
  return jnp.stack(heads, axis=1)


def unpack_heads(o_XKGE: jax.Array, windows, head_dim: int) -> jax.Array:
  """Inverse of pack_heads: [A, K, G, E] -> [A, K, G, H]."""
  heads = []
  for h, (lo, _) in enumerate(windows):
    offset = h * head_dim - lo
    heads.append(o_XKGE[:, h, :, offset:offset + head_dim])  # [A, G, H]
  return jnp.stack(heads, axis=1)


def sublanes(dtype) -> int:
  """Rows of one native VMEM tile: 8 for 32-bit, 16 for bf16 (two rows packed per sublane)."""
  return 8 * (4 // jnp.dtype(dtype).itemsize)


def chunk_copies(tables_ref, table_start, num_pages, chunk, slot, hbm_refs, buf_refs, sem_ref):
  """The DMAs of K and V pages [chunk * Q, (chunk + 1) * Q) of one sequence into buffer `slot`.

  tables_ref: the flat page tables in SMEM, the sequence's row starting at table_start.
  hbm_refs: (K, V) [P, Z, M] in HBM; buf_refs: (K, V) [2, Q, Z, M] VMEM; sem_ref: DMA [2, 2].
  Pages past the sequence's last one re-read that last page: its data is real (finite), and the
  positions are masked, so the chunk never multiplies garbage (0 * nan) into the output.
  """
  per_chunk = buf_refs[0].shape[1]
  copies = []
  for i in range(per_chunk):
    index = jnp.minimum(chunk * per_chunk + i, num_pages - 1)
    page = tables_ref[table_start + index]
    for kv, (hbm_ref, buf_ref) in enumerate(zip(hbm_refs, buf_refs)):
      copies.append(pltpu.make_async_copy(hbm_ref.at[page], buf_ref.at[slot, i],
                                          sem_ref.at[kv, slot]))
  return copies


def start_all(copies):
  for copy in copies:
    copy.start()


def wait_all(copies):
  for copy in copies:
    copy.wait()


def run_chunks(num_chunks, fetch, compute, carry):
  """A double-buffered loop over KV chunks: chunk c + 1's DMAs fly while chunk c is computed.

  fetch(chunk, slot) -> the chunk's copies; compute(chunk, slot, carry) -> carry.
  """

  @pl.when(num_chunks > 0)
  def _():
    start_all(fetch(0, 0))

  def body(chunk, carry):
    slot = lax.rem(chunk, 2)

    @pl.when(chunk + 1 < num_chunks)
    def _():
      start_all(fetch(chunk + 1, 1 - slot))

    wait_all(fetch(chunk, slot))
    return compute(chunk, slot, carry)

  return lax.fori_loop(0, num_chunks, body, carry)


def load_window(buf_ref, slot, window, dtype) -> jax.Array:
  """[Q, Z, M] buffer slot -> [C, Hv] keys (or values) of one head window (Hv = hi - lo)."""
  lo, hi = window
  per_chunk, page_size, _ = buf_ref.shape[1:]
  chunk = buf_ref[slot, :, :, pl.ds(lo, hi - lo)]  # [Q, Z, Hv]
  return chunk.reshape(per_chunk * page_size, hi - lo).astype(dtype)


def slab_copies(tables_ref, table_start, num_pages, chunk, slot, hbm_refs, buf_refs, sem_ref,
                index):
  """chunk_copies for any page layout (page_layout.py): the slabs of pages [chunk * Q, (chunk +
  1) * Q) of one sequence, J per page and pool (J = K when a slab holds one head, else 1).

  hbm_refs: K, V pools [Y, Z, M] (then K, V scale pools [Y, Z, Ks]) in HBM; buf_refs: likewise
  [2, Q, J, Z, M] VMEM; sem_ref: DMA [len(hbm_refs), 2]. Past-the-end pages as chunk_copies.
  """
  per_chunk, num_slabs = buf_refs[0].shape[1:3]
  copies = []
  for i in range(per_chunk):
    page = tables_ref[table_start + jnp.minimum(chunk * per_chunk + i, num_pages - 1)]
    for j in range(num_slabs):
      for pool, (hbm_ref, buf_ref) in enumerate(zip(hbm_refs, buf_refs)):
        slab = index.slab(page, pool % 2, j)  # Pools alternate K, V (values, then scales).
        copies.append(pltpu.make_async_copy(hbm_ref.at[slab], buf_ref.at[slot, i, j],
                                            sem_ref.at[pool, slot]))
  return copies


def scratch_shapes(per_chunk: int, page_size: int, width: int, kv_dtype):
  """Double-buffered VMEM for K and V chunks, and their DMA semaphores [kv, slot]."""
  buf = pltpu.VMEM((2, per_chunk, page_size, width), kv_dtype)
  return [buf, buf, pltpu.SemaphoreType.DMA((2, 2))]


def token_major_operands(k_pages, v_pages, dims, per_chunk: int):
  """The K/V pages [P, Z, K, H] as [P, Z, K * H] rows (a free view), and their scratch."""
  width = k_pages.shape[-2] * k_pages.shape[-1]
  as_rows = lambda pages: pages.reshape(dims.num_pages, dims.page_size, width)
  scratch = scratch_shapes(per_chunk, dims.page_size, width, k_pages.dtype)
  return (as_rows(k_pages), as_rows(v_pages)), scratch


def call_over_pages(kernel, scalars, q_win, q_spec, hbm_arrays, scratch, *, out_dtype, grid,
                    interpret, name):
  """Runs `kernel` over `grid` with the scalar-prefetched `scalars` (page tables first), q
  windows blocked by `q_spec` into VMEM, and `hbm_arrays` (K/V pages or pools) left in HBM for
  the kernel's own double-buffered copies into `scratch`. Returns the output windows: q_win's
  shape, out_dtype."""
  hbm_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(scalars),
          grid=grid,
          in_specs=[q_spec] + [hbm_spec] * len(hbm_arrays),
          out_specs=q_spec,
          scratch_shapes=scratch,
      ),
      out_shape=jax.ShapeDtypeStruct(q_win.shape, out_dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=(pltpu.PARALLEL,)),
      interpret=interpret,
      name=name,
  )(*scalars, q_win, *hbm_arrays)
