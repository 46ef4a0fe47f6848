"""Argument checks shared by the ragged kernels and their reference: ValueError naming the bad
argument, and the static sizes of one call. Shape letters: the key in jaxserve/model/__init__.py."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kernels_pallas import common, kv_quant, ragged_layout

KV_DTYPES = kv_quant.STORAGE


@dataclasses.dataclass(frozen=True)
class RaggedDims:
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  num_layers: int  # L (1 when no layer is given)
  num_pages: int  # P of one layer
  page_size: int  # Z
  num_seqs_max: int  # B: the padded sequence count
  pages_per_seq: int  # W
  layout: ragged_layout.RaggedLayout

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads


_require, _int_array = common.require, common.check_int_array


def _scalar(x, name: str):
  _require(jnp.ndim(x) == 0, f"{name} must be a scalar, got shape {jnp.shape(x)}")
  _require(jnp.issubdtype(jnp.result_type(x), jnp.integer),
           f"{name} must be an integer, got {jnp.result_type(x)}")


def _check_new_tokens(q, k_new, v_new):
  _require(q.ndim == 3, f"q must be [tokens, num_heads, head_dim], got shape {q.shape}")
  _require(k_new.ndim == 3 and k_new.shape[0] == q.shape[0] and k_new.shape[2] == q.shape[2],
           f"k_new must be [{q.shape[0]}, num_kv_heads, {q.shape[2]}] like q, got {k_new.shape}")
  _require(v_new.shape == k_new.shape, f"v_new must have k_new's shape {k_new.shape}, got "
                                       f"{v_new.shape}")
  _require(q.shape[1] % k_new.shape[1] == 0, f"q num_heads {q.shape[1]} must be a multiple of "
                                             f"k_new num_kv_heads {k_new.shape[1]}")


def _check_pages(kv_pages, layer, layout):
  want = "[L, P, page_size, lanes]" if layer is not None else "[P, page_size, lanes]"
  _require(kv_pages.ndim == (4 if layer is not None else 3),
           f"kv_pages must be {want}{' with layer' if layer is not None else ''}, got shape "
           f"{kv_pages.shape}")
  _require(kv_pages.dtype in KV_DTYPES, f"kv_pages must be one of "
                                        f"{[d.name for d in KV_DTYPES]}, got {kv_pages.dtype}")
  _require(kv_pages.shape[-1] == layout.lanes,
           f"kv_pages lanes {kv_pages.shape[-1]} != {layout.lanes}, the ragged layout of "
           f"{layout.num_kv_heads} KV heads of head_dim {layout.head_dim}")


def check_args(q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens, num_seqs, layer,
               sliding_window, attend_until=None) -> RaggedDims:
  """Checks every argument of ragged_paged_attention; raises ValueError naming the bad one."""
  if attend_until is not None:
    _int_array(attend_until, "attend_until", (q.shape[0],))
  _check_new_tokens(q, k_new, v_new)
  num_kv_heads, head_dim = k_new.shape[1:]
  layout = ragged_layout.layout_for(num_kv_heads, head_dim, kv_pages.dtype)
  _check_pages(kv_pages, layer, layout)
  if layer is not None:
    _scalar(layer, "layer")
  _require(getattr(page_tables, "ndim", 0) == 2, f"page_tables must be 2-D [num_seqs, pages], "
                                                  f"got shape {jnp.shape(page_tables)}")
  num_seqs_max, width = page_tables.shape
  _int_array(page_tables, "page_tables", (num_seqs_max, width))
  _int_array(kv_lens, "kv_lens", (num_seqs_max,))
  _int_array(cu_q_lens, "cu_q_lens", (num_seqs_max + 1,))
  _scalar(num_seqs, "num_seqs")
  _require(sliding_window is None or (isinstance(sliding_window, int) and sliding_window >= 1),
           f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
  shape = kv_pages.shape if layer is not None else (1, *kv_pages.shape)
  return RaggedDims(q.shape[1], num_kv_heads, head_dim, shape[0], shape[1], shape[2],
                    num_seqs_max, width, layout)


def kv_scales(kv_dtype, k_scale: float | None, v_scale: float | None) -> tuple[float, float]:
  """float8 pages' per-tensor scales (1.0 when None); other dtypes take none."""
  given = [x for x in (k_scale, v_scale) if x is not None]
  if not kv_quant.is_float8(kv_dtype):
    _require(not given, f"k_scale and v_scale are for float8 kv_pages, not {kv_dtype}")
  for x in given:
    _require(isinstance(x, (int, float)) and math.isfinite(x) and x > 0,
             f"k_scale and v_scale must be positive finite floats, got {x!r}")
  return (1.0 if k_scale is None else float(k_scale), 1.0 if v_scale is None else float(v_scale))


def scale(sm_scale: float | None, head_dim: int) -> float:
  return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
