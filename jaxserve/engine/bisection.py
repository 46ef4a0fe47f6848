"""Bisection on device, for sampling's thresholds (engine/sample.py): a fixed number of halvings
in a `fori_loop`, so the search costs the same whatever a row holds, and no sort of [B, V] runs
(on CPU a 49k-wide sort per row costs ~10x more)."""

import jax
import jax.numpy as jnp


def order_keys(x):
  """float32 [...] -> uint32 [...] in the same order (-inf lowest): IEEE bits, with negatives'
  bits flipped and positives' sign bit set. 32 halvings of [0, 2**32) end on a threshold key
  exactly, whatever the row holds (-inf from ignore_eos or a logit bias, or a range of 1e38
  that float halvings would not resolve)."""
  # -0.0 as 0.0: adding a logit bias row (zeros without one) always made it so.
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def bisect_int(ok, lo, hi, iters: int):
  """The largest integer t in [lo, hi] with ok(t), for ok true at lo and monotone decreasing in
  t; exact after `iters` >= log2(hi - lo + 1) halvings. Unsigned: hi - lo never overflows."""

  def halve(_, bounds):
    lo, hi = bounds
    span = hi - lo
    mid = lo + span // 2 + (span & 1)  # The upper middle, so lo = mid always makes progress.
    good = ok(mid) & (span > 0)
    return jnp.where(good, mid, lo), jnp.where(good | (span == 0), hi, mid - 1)

  return jax.lax.fori_loop(0, iters, halve, (lo, hi))[0]


def bisect(ok, lo, hi, iters: int):
  """The largest t in [lo, hi] with ok(t), for ok true at lo and monotone decreasing in t."""

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) / 2
    good = ok(mid)
    return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

  return jax.lax.fori_loop(0, iters, halve, (lo, hi))[0]
