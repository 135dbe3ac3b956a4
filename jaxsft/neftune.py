"""NEFTune: uniform noise on the input embeddings while training (Jain et al. 2023, TRL's
`SFTConfig.neftune_noise_alpha`).

For a sequence of real length L (its tokens, padding not counted) and hidden size d, every
element of its input embeddings gets independent noise

    ε ~ U(−α / √(L·d),  α / √(L·d)),

the scale of the NEFTune paper's reference code (which counts L from the attention mask;
transformers' hook counts the padded width instead, which would make the noise depend on the
bucket a sequence lands in). Padding positions get none. In a packed row every example is its
own sequence: L is the length of the example a token belongs to.

The noise is drawn only in the training step (`jaxsft.step`), from a key derived from the run's
seed and the micro-batch index, so a run and its resume draw the same noise; evaluation,
generation and export never see it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NOISE_STREAM = 0x4E454654  # "NEFT": the noise keys' branch of the run's key, apart from dropout's


def noise_key(base_key: jax.Array, micro_index) -> jax.Array:
  """The noise key of micro-batch `micro_index` (the dropout key folds the same index into
  `base_key` itself; this one folds it into a branch of it, so the two never coincide)."""
  return jax.random.fold_in(jax.random.fold_in(base_key, NOISE_STREAM), micro_index)


def sequence_lengths(shape: tuple[int, int], attention_mask: jax.Array | None,
                     segment_ids: jax.Array | None) -> jax.Array:
  """(B, T) int32: for every position, the real length of the sequence it belongs to (0 at padding).

  Packed rows (`segment_ids`, 1, 2, ... per example, 0 on padding): the length of the position's
  example; otherwise the row's count of attended positions (all T without a mask).
  """
  b, t = shape
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    # Each (row, segment) pair gets its own bucket of a flat segment sum: O(B·T), not O(B·T²).
    flat = (segment_ids + jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1)).reshape(-1)
    counts = jax.ops.segment_sum(jnp.ones_like(flat), flat, num_segments=b * (t + 1))
    return jnp.where(segment_ids > 0, counts[flat].reshape(b, t), 0)
  if attention_mask is None:
    return jnp.full((b, t), t, jnp.int32)
  real = jnp.asarray(attention_mask) > 0
  return jnp.where(real, jnp.sum(real, axis=1, keepdims=True, dtype=jnp.int32), 0)


def noise(key: jax.Array, alpha: float, shape: tuple[int, int, int], attention_mask: jax.Array | None = None,
          segment_ids: jax.Array | None = None) -> jax.Array:
  """The (B, T, d) float32 noise ε of the module docstring (0 at padding)."""
  b, t, d = shape
  lengths = sequence_lengths((b, t), attention_mask, segment_ids).astype(jnp.float32)
  bound = jnp.where(lengths > 0, alpha / jnp.sqrt(jnp.maximum(lengths, 1.0) * d), 0.0)
  return jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0) * bound[..., None]


def embedding_noise(key: jax.Array, alpha: float, attention_mask=None, segment_ids=None):
  """A function embeddings → embeddings + ε for `CausalLM.hidden_states(embeddings_hook=...)`."""

  def add_noise(embeddings: jax.Array) -> jax.Array:
    eps = noise(key, alpha, embeddings.shape, attention_mask, segment_ids)
    return (embeddings.astype(jnp.float32) + eps).astype(embeddings.dtype)

  return add_noise
