"""Gumbel noise keyed by (seed, position), for sample.py's random draws.

argmax(logits + Gumbel noise) is a draw from softmax(logits). The noise of a row comes from its
request's 64-bit seed and the token's position alone, so a seeded request draws the same tokens
whatever else shares its batch, and again after a preemption.

Why this module copies JAX's threefry layout: sample.py's fast path draws among a few hundred
candidate tokens, and must add exactly the noise jax.random.gumbel(key, (V,)) gives those ids,
so that its token is the one the whole-vocabulary draw (`gumbel_draw`) would pick. JAX has no
public call for "elements ids of a random stream": jax.random.gumbel and jax.random.bits make
all V. So `gumbel_at` hashes each id with the public threefry primitive
(jax.extend.random.threefry2x32_p) the way jax/_src/random/threefry2x32.py lays out its counters
(`_threefry_random_bits_partitionable` and `_original`, both modes), then turns bits into a
uniform and the uniform into Gumbel noise as jax/_src/random/core.py's `_uniform` and `_gumbel`
do. Those layouts are private and may change with a JAX upgrade:
- a different PRNG implementation, or jax_high_dynamic_range_gumbel, is caught at trace time:
  `is_jax_gumbel()` is then False, no row counts as fitting the fast path, and every sampled row
  takes the whole-vocabulary draw (the same tokens, slower);
- a changed counter layout or bits-to-float step is not caught at run time: fast-path tokens
  would then differ from the whole draw's, so a seeded request's tokens would depend on its
  batch. tests/test_sample_candidates.py (`test_gumbel_at_is_jax_random_gumbel_at_those_ids`)
  compares the two bit for bit in both modes; run it on every JAX upgrade.
Hashing (key, id) ourselves in both paths would drop the dependency, but would change every
seeded output when jax_threefry_partitionable is off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

# jax.random.gumbel's largest value: -log(-log(1 - 2**-23)) = 15.94 (its uniforms have 23 bits).
GUMBEL_MAX = 16.0


def noise_key(seed, position):
  """The key of one token's noise: seed [2] uint32 (a 64-bit seed's two words), position []."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), position)


def gumbel_draw(scaled, seeds, positions):
  """Gumbel-max over the whole row: scaled [B, V] (temperature-scaled logits, -inf where
  filtered out), seeds [B, 2], positions [B] -> tokens [B]."""
  noise = lambda seed, position: jax.random.gumbel(noise_key(seed, position), scaled.shape[1:])
  perturbed = scaled + jax.vmap(noise)(seeds, positions)  # [B, V]
  # jnp.argmax's first maximum, as a max and a min: XLA:CPU's variadic argmax reduction is
  # many times slower. (A NaN row, a broken model's, gets some token, not its first NaN.)
  V = scaled.shape[-1]
  best = jnp.max(perturbed, -1, keepdims=True)
  first = jnp.min(jnp.where(perturbed == best, jnp.arange(V), V), -1)
  return jnp.minimum(first, V - 1).astype(positions.dtype)


def gumbel_at(seeds, positions, ids, V: int):
  """jax.random.gumbel(noise_key(seed, position), (V,))[ids] for each row, without the other
  V - Vc values: threefry's bits for element j hash (key, j) alone. seeds [B, 2], positions [B],
  ids [B, Vc] -> [B, Vc] float32."""
  tiny = jnp.finfo(jnp.float32).tiny

  def one(seed, position, j):
    k1, k2 = jax.random.key_data(noise_key(seed, position))
    j = j.astype(jnp.uint32)
    k1, k2 = jnp.broadcast_to(k1, j.shape), jnp.broadcast_to(k2, j.shape)
    if jax.config.jax_threefry_partitionable:  # element j hashes the 64-bit counter (0, j)
      b1, b2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(j), j)
      bits = b1 ^ b2
    else:  # counters 0..V-1 (padded to even) hashed in pairs (i, i + half)
      half = (V + 1) // 2
      low = j < half
      x0 = jnp.where(low, j, j - half)
      x1 = jnp.where(low, jnp.where(j + half < V, j + half, 0), j)
      b1, b2 = threefry2x32_p.bind(k1, k2, x0, x1)
      bits = jnp.where(low, b1, b2)
    # _uniform's step: 23 random mantissa bits under the exponent of 1.0 give [1, 2); minus 1.
    floats = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    uniform = jnp.maximum(tiny, floats * (jnp.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))

  return jax.vmap(one)(seeds, positions, ids)


def is_jax_gumbel() -> bool:
  """Whether jax.random.gumbel is the one `gumbel_at` reproduces (JAX's default)."""
  return (jax.config.jax_default_prng_impl == "threefry2x32"
          and not jax.config.jax_high_dynamic_range_gumbel)
