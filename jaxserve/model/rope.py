"""Rotary position embeddings: the frequencies of each family's RoPE (plain, Llama 3's scaling,
LongRoPE) and the rotation, in Hugging Face's rotate-half layout; M-RoPE (Qwen2.5-VL) rotates
by three positions per token, each on its own section of the frequencies.

Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.config import LongRope, ModelConfig
from jaxserve.model import attention


def rope_frequencies(cfg: ModelConfig, meta: attention.AttentionMetadata):
  """[H/2] inverse frequencies, with Llama-3 scaling when the config asks for it; with LongRoPE,
  [1, T, H/2]: each token's own (_longrope)."""
  exponents = jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim
  s = cfg.rope_scaling
  if isinstance(s, LongRope):
    return _longrope(s, cfg.rope_theta ** exponents, meta)
  inv_freq = 1.0 / (cfg.rope_theta ** exponents)
  if s is None:
    return inv_freq
  # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
  wavelen = 2 * jnp.pi / inv_freq
  low_wavelen = s.original_max_position / s.low_freq_factor
  high_wavelen = s.original_max_position / s.high_freq_factor
  smooth = ((s.original_max_position / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor))
  mid = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
  return jnp.where(wavelen < high_wavelen, inv_freq,
                   jnp.where(wavelen > low_wavelen, inv_freq / s.factor, mid))


def _longrope(s: LongRope, wavelengths, meta: attention.AttentionMetadata):
  """[1, T, H/2]: a token's frequencies are the long ones when its sequence is longer than
  s.original_max_position once this step's tokens are in (transformers picks the set by a
  forward's largest position, for all its tokens; here each sequence of a step picks its own, so
  a token's output does not depend on its batch). Keys cached before keep the set they had, as
  in transformers' generate."""
  T, B = meta.positions.shape[1], meta.kv_lens.shape[0]
  seq = jnp.clip(jnp.searchsorted(meta.cu_q_lens, jnp.arange(T), side="right") - 1, 0, B - 1)
  long = (meta.kv_lens[seq] > s.original_max_position)[None, :, None]  # [1, T, 1]
  short_freq = 1.0 / (jnp.asarray(s.short_factor, jnp.float32) * wavelengths)  # [H/2]
  long_freq = 1.0 / (jnp.asarray(s.long_factor, jnp.float32) * wavelengths)
  return jnp.where(long, long_freq, short_freq)


def rope_scale(cfg: ModelConfig) -> float:
  """What q and k are multiplied by after rotation: LongRoPE's attention factor, else 1."""
  return cfg.rope_scaling.attention_factor if isinstance(cfg.rope_scaling, LongRope) else 1.0


def rope_positions(cfg: ModelConfig, meta: attention.AttentionMetadata):
  """[B, T] each token's rotary position: its position; with M-RoPE, [3, B, T] its three
  (AttentionMetadata.rope_positions)."""
  return meta.rope_positions if cfg.mrope_section else meta.positions


def apply_rope(x, positions, inv_freq, scale: float = 1.0, section: tuple[int, ...] = ()):
  """x [B, T, heads, H], positions [B, T], inv_freq [H/2] or [B, T, H/2]. Hugging Face's
  rotate-half layout; cos and sin times `scale`, as transformers applies an attention factor.
  With an M-RoPE `section` (s0, s1, s2 summing to H/2), positions are [3, B, T] and frequency j
  turns by axis 0's position for j < s0, axis 1's for the next s1, axis 2's for the rest
  (Qwen2-VL's multimodal RoPE: time, height, width)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2] or [3, B, T, H/2]
  if section:
    axis = np.repeat(np.arange(len(section)), section)  # [H/2]: each frequency's axis.
    angles = sum(jnp.where(axis == a, angles[a], 0.0) for a in range(len(section)))
  sin = jnp.sin(angles)[:, :, None, :]  # [B, T, 1, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  if scale != 1.0:
    sin, cos = sin * scale, cos * scale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, heads, H/2] each
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
