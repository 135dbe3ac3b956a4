"""Rotary position embedding (RoPE): inverse frequencies with the Llama-3 and linear scaling
variants, Gemma 3's unscaled local base, the cos/sin tables, and the rotation itself, in float32
like transformers."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsft.models.families import LlamaConfig


@functools.lru_cache(maxsize=32)
def _inv_freq(dim: int, theta: float, scaling: tuple[tuple[str, Any], ...] | None) -> np.ndarray:
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
  if scaling is None:
    return inv_freq
  s = dict(scaling)
  if s["rope_type"] == "linear":
    return (inv_freq / np.float32(s["factor"])).astype(np.float32)
  factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
  old_len = s["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_inv_freq(config: LlamaConfig, kind: str = "global") -> np.ndarray | None:
  """Inverse frequencies θ^(-2i/d) over the rotary dims, float32 like transformers: "global"
  with the config's scaling (Llama-3 or linear), "local" with `rope_local_theta` unscaled
  (Gemma 3's sliding layers), "none" (no RoPE: None)."""
  if kind == "none":
    return None
  if kind == "local":
    return _inv_freq(config.rotary_dim, config.rope_local_theta, None)
  return _inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray | None, dtype, *,
                rotary_dim: int | None = None) -> tuple[jax.Array, jax.Array]:
  """cos, sin of shape (B, T, 1, R/2): one column per frequency (transformers repeats them
  twice, rotate-half layout; `apply_rope` uses each for both halves). Without frequencies (a
  layer without RoPE) cos = 1 and sin = 0, which `apply_rope` passes through exactly
  (x·1 + r·0 = x)."""
  if inv_freq is None:
    shape = (*positions.shape, 1, rotary_dim // 2)
    return jnp.ones(shape, dtype), jnp.zeros(shape, dtype)
  freqs = positions.astype(jnp.float32)[..., None, None] * jnp.asarray(inv_freq)
  return jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x * cos + rotate_half(x) * sin on (B, T, heads, D), over the first R = 2 * cos.shape[-1]
  dimensions (partial rotary); the rest pass through.

  The rotated dims are viewed as two halves (x₁, x₂), rotate_half(x) = (-x₂, x₁): a reversal of
  that axis times a sign, the same products as transformers' concatenation, but an index map
  that XLA fuses (forward and backward) instead of slices, pads and concatenations.
  """
  half = cos.shape[-1]
  rot = 2 * half
  if rot < x.shape[-1]:
    return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
  pairs = x.reshape(*x.shape[:-1], 2, half)
  rotated = jnp.flip(pairs, axis=-2) * jnp.asarray([[-1], [1]], x.dtype)
  return (pairs * cos[..., None, :] + rotated * sin[..., None, :]).reshape(x.shape)
