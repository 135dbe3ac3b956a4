"""Causal self-attention: the masks (training and KV cache), the KV cache, and every attention
path with the dispatch between them.

  einsum_attention         a plain grouped-query reference
  dense_attention          `jax.nn.dot_product_attention` (XLA), every (query, key) pair
  causal_block_attention   head-major query blocks that skip the keys a block cannot see, with
                           FlashAttention's backward pass (a custom VJP)
  cudnn_attention          cuDNN flash attention (NVIDIA GPU, 16-bit floats)
  self_attention           causal self-attention without a cache: cuDNN where it runs, else
                           `causal_block_attention`

`ATTENTION` maps a model's `attention` name to the path it takes with a cache or any mask.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name


def causal_window(query_idx: jax.Array, key_idx: jax.Array, sliding_window: int | None) -> jax.Array:
  """Boolean (1, Tq, S): key at or before the query and, with a window, less than it behind."""
  allowed = (query_idx[:, None] >= key_idx[None, :])[None]
  if sliding_window is not None:
    allowed = allowed & ((query_idx[:, None] - key_idx[None, :]) < sliding_window)[None]
  return allowed


def attention_mask_4d(batch: int, length: int, attention_mask: jax.Array | None,
                      segment_ids: jax.Array | None, sliding_window: int | None) -> jax.Array:
  """Boolean (B, 1, T, T): causal, real keys only, same segment, optional sliding window.

  A query whose every key is masked (a padding position with no real key before it) is left
  to the attention's finite large-negative fill: it gets a uniform average, never NaN, and
  its output only reaches positions whose labels are -100.
  """
  idx = jnp.arange(length)
  allowed = causal_window(idx, idx, sliding_window)
  if attention_mask is not None:
    allowed = allowed & (attention_mask[:, None, :] != 0)
  if segment_ids is not None:
    allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return jnp.broadcast_to(allowed, (batch, length, length))[:, None]


def cache_attention_mask(start, num_new: int, key_mask: jax.Array,
                         sliding_window: int | None) -> jax.Array:
  """Boolean (B, 1, t, S) for t new tokens at cache slots [start, start + t) over S slots.

  Causal by slot, visible key slots only (`key_mask` (B, S) != 0), and the window counted in
  slots: the cache's user must lay tokens out so that slot distance is position distance.
  """
  slots = jnp.arange(key_mask.shape[1])
  allowed = causal_window(start + jnp.arange(num_new), slots, sliding_window)
  return (allowed & (key_mask[:, None, :] != 0))[:, None]


class KVCache(NamedTuple):
  """Rotated keys and the values at every cache slot: (B, S, K, D) for one layer, (L, B, S, K, D)
  for the stacked decoder (the layer scan hands each layer its own slice)."""

  keys: jax.Array
  values: jax.Array

  def write(self, keys: jax.Array, values: jax.Array, start) -> KVCache:
    """The cache with the (B, t, K, D) keys/values of t new tokens at slots [start, start + t)."""
    def put(cache, new):
      return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), start, axis=1)
    return KVCache(put(self.keys, keys), put(self.values, values))


def einsum_attention(q, k, v, mask, scale):
  """Grouped-query attention with einsums: q (B,T,N,D), k/v (B,S,K,D), mask (B,1,T,S)."""
  b, t, n, d = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
  scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, n, d)


def dense_attention(q, k, v, mask, scale):
  """`jax.nn.dot_product_attention`, XLA implementation, every (query, key) pair computed
  (handles GQA and float32 softmax)."""
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")


def auto_causal_block(length: int) -> int:
  """The query block of `causal_block_attention` for T = `length` when none is given: a quarter
  of the sequence, rounded up to a multiple of 8, within [64, 128] (T ≤ 64 runs as one block).
  Smaller blocks skip more of the upper triangle but cost more per computed pair; these bounds
  were the fastest in the real SmolLM2 train step on a CPU (benchmarks/results/performance_notes.md)."""
  return min(128, max(64, -(-length // 32) * 8))


def causal_block_attention(q, k, v, mask, scale, *, block: int | None, sliding_window: int | None,
                           operand_dtype=None):
  """`dense_attention` of causal self-attention, query block by query block, over only the keys
  a block can see: [max(0, start - window + 1), stop) for queries [start, stop).

  The key blocks above the diagonal (and, with a window, those behind it) are never computed:
  for T = n·block that is (n + 1) / 2n of the dense work, e.g. 3/4 at T = 512, block 256.
  `mask` (B, 1, T, T) still applies inside each block (padding, packed segments), so the
  result is the dense one whenever `mask` is causal (and windowed by `sliding_window`).
  `block` None: `auto_causal_block(T)`.

  q, k and v are laid out head-major once, (B, K, G, T, D) and (B, K, S, D) for K key/value
  heads of G queries each, so every block is a slice and the grouped products need no further
  copies; the softmax is float32 and masked keys get `dense_attention`'s large negative score.
  The backward pass is FlashAttention's (`_block_attention_bwd`).

  `operand_dtype` (None: q's dtype) is the dtype every product takes its operands in: q, k, v,
  the probabilities and the output's cotangent are rounded to it, and each product accumulates
  in float32. A bfloat16 model on a CPU has float32 activations but bf16 product kernels
  (`jaxsft.matmul.product_dtype`): its attention then runs on those kernels, as PyTorch's
  attention does on a bf16 model. The output and the gradients keep q's dtype.
  """
  b, t, n, d = q.shape
  kv_heads = k.shape[2]
  qh = q.reshape(b, t, kv_heads, n // kv_heads, d).transpose(0, 2, 3, 1, 4)
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  blocks = query_blocks(t, auto_causal_block(t) if block is None else block, sliding_window)
  operands = jnp.dtype(q.dtype if operand_dtype is None else operand_dtype)
  out = _block_attention(qh, kh, vh, mask, float(scale), blocks, operands)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, d)


def query_blocks(length: int, block: int, sliding_window: int | None) -> tuple[tuple[int, int, int], ...]:
  """(first key, start, stop) per query block [start, stop): the keys [first key, stop) it sees."""
  return tuple((0 if sliding_window is None else max(0, start - sliding_window + 1), start,
                min(start + block, length)) for start in range(0, length, block))


_MASKED_SCORE = -0.7 * float(np.finfo(np.float32).max)
ATTENTION_RESIDUALS = ("attention_out", "attention_max", "attention_inv_sum")


def _block_rows(x, start, stop):
  """Queries [start, stop) of (B, K, G, T, D) as (B, K, G·t, D): one product per key/value head."""
  b, kv_heads, _, _, d = x.shape
  return x[:, :, :, start:stop].reshape(b, kv_heads, -1, d)


def _block_scores(qh, kh, mask, scale, first_key, start, stop):
  """Masked float32 scores of a query block, (B, K, G, t, s)."""
  b, kv_heads, groups, _, _ = qh.shape
  scores = jnp.einsum("bkmd,bksd->bkms", _block_rows(qh, start, stop), kh[:, :, first_key:stop],
                      preferred_element_type=jnp.float32) * jnp.float32(scale)
  scores = scores.reshape(b, kv_heads, groups, stop - start, stop - first_key)
  return jnp.where(mask[:, :, None, start:stop, first_key:stop], scores, _MASKED_SCORE)


def _block_attention_fwd(qh, kh, vh, mask, scale, blocks, operands):
  """Softmax(Q Kᵀ · scale) V block by block, the products on `operands`; saves each query's row
  maximum and 1 / row sum."""
  out_dtype = qh.dtype
  qh, kh, vh = qh.astype(operands), kh.astype(operands), vh.astype(operands)
  b, kv_heads, groups, _, d = qh.shape
  outs, maxes, inv_sums = [], [], []
  for first_key, start, stop in blocks:
    scores = _block_scores(qh, kh, mask, scale, first_key, start, stop)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    exp = jnp.exp(scores - row_max)
    inv_sum = 1.0 / jnp.sum(exp, axis=-1, keepdims=True)
    probs = (exp * inv_sum).astype(vh.dtype).reshape(b, kv_heads, -1, stop - first_key)
    out = jnp.einsum("bkms,bksd->bkmd", probs, vh[:, :, first_key:stop],
                     preferred_element_type=jnp.float32).astype(out_dtype)
    outs.append(out.reshape(b, kv_heads, groups, stop - start, d))
    maxes.append(row_max)
    inv_sums.append(inv_sum)
  # Named so that a layer's remat policy can keep them (`ATTENTION_RESIDUALS`): the backward
  # pass then needs no second forward pass through the attention.
  out, row_max, inv_sum = (checkpoint_name(jnp.concatenate(xs, axis=3), name)
                           for xs, name in zip((outs, maxes, inv_sums), ATTENTION_RESIDUALS))
  return out, (qh, kh, vh, mask, out, row_max, inv_sum)


def _block_attention_bwd(scale, blocks, operands, residuals, d_out):
  """FlashAttention's backward pass, block by block, with P = exp(S - max) / sum recomputed
  from the saved row statistics and Δ = rowsum(dO ⊙ O) (= rowsum(dP ⊙ P)):
    dV = Pᵀ dO,   dS = P ⊙ (dO Vᵀ - Δ) · scale,   dQ = dS K,   dK = dSᵀ Q.
  dV and dK are accumulated transposed, (dOᵀ P)ᵀ and (Qᵀ dS)ᵀ, as (D, S) sums over the blocks."""
  qh, kh, vh, mask, out, row_max, inv_sum = residuals  # qh, kh, vh already in `operands`
  b, kv_heads, groups, _, d = qh.shape
  grad_dtype = d_out.dtype  # the output's dtype, and so q's, k's and v's
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  d_out = d_out.astype(operands)
  dq_blocks = []
  dk_t = jnp.zeros((b, kv_heads, d, kh.shape[2]), jnp.float32)
  dv_t = jnp.zeros((b, kv_heads, d, vh.shape[2]), jnp.float32)
  for first_key, start, stop in blocks:
    rows = slice(start, stop)
    scores = _block_scores(qh, kh, mask, scale, first_key, start, stop)
    probs = jnp.exp(scores - row_max[:, :, :, rows]) * inv_sum[:, :, :, rows]
    d_block = _block_rows(d_out, start, stop)  # (B, K, G·t, D)
    flat = lambda x: x.reshape(b, kv_heads, -1, stop - first_key)  # noqa: E731
    dv_t = dv_t.at[:, :, :, first_key:stop].add(jnp.einsum(
        "bkdm,bkms->bkds", d_block.swapaxes(2, 3), flat(probs).astype(vh.dtype),
        preferred_element_type=jnp.float32))
    d_probs = jnp.einsum("bkmd,bksd->bkms", d_block, vh[:, :, first_key:stop], preferred_element_type=jnp.float32)
    d_scores = flat(probs * (d_probs.reshape(probs.shape) - delta[:, :, :, rows]) * jnp.float32(scale))
    d_scores = d_scores.astype(qh.dtype)
    dq = jnp.einsum("bkms,bksd->bkmd", d_scores, kh[:, :, first_key:stop], preferred_element_type=jnp.float32)
    dq_blocks.append(dq.reshape(b, kv_heads, groups, stop - start, d))
    dk_t = dk_t.at[:, :, :, first_key:stop].add(jnp.einsum(
        "bkdm,bkms->bkds", _block_rows(qh, start, stop).swapaxes(2, 3), d_scores,
        preferred_element_type=jnp.float32))
  dq = jnp.concatenate(dq_blocks, axis=3)
  return (dq.astype(grad_dtype), dk_t.swapaxes(2, 3).astype(grad_dtype), dv_t.swapaxes(2, 3).astype(grad_dtype),
          None)


_block_attention = jax.custom_vjp(lambda qh, kh, vh, mask, scale, blocks, operands:
                                  _block_attention_fwd(qh, kh, vh, mask, scale, blocks, operands)[0],
                                  nondiff_argnums=(4, 5, 6))
_block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)


def cudnn_attention(q, k, v, mask, scale, *, sliding_window: int | None):
  """cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) for causal
  self-attention in 16-bit floats on an NVIDIA GPU: causal and window blocks are skipped by the
  kernel (`is_causal`, `local_window_size`), `mask` adds padding and packed segments."""
  window = None if sliding_window is None else (sliding_window - 1, 0)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                      local_window_size=window, implementation="cudnn")


def self_attention(q, k, v, mask, scale, *, block: int | None, sliding_window: int | None,
                   operand_dtype=None):
  """Causal self-attention (no cache) by the fastest path the backend offers.

  GPU with bfloat16/float16: cuDNN (`cudnn_attention`); anywhere else, or when cuDNN refuses
  the shapes while tracing: `causal_block_attention`, its products on `operand_dtype` (None: q's).
  """
  if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
    try:
      return cudnn_attention(q, k, v, mask, scale, sliding_window=sliding_window)
    except (NotImplementedError, ValueError, RuntimeError):  # e.g. a head size cuDNN lacks
      pass
  return causal_block_attention(q, k, v, mask, scale, block=block, sliding_window=sliding_window,
                                operand_dtype=operand_dtype)


def xla_attention(q, k, v, mask, scale):
  """The "xla" attention with a cache (decoding) or any non-causal mask: `dense_attention`."""
  return dense_attention(q, k, v, mask, scale)


# name -> attention over a KV cache / any mask. Without a cache, "xla" runs `self_attention`
# (causal block skipping, cuDNN on a GPU); "dense" always computes every pair.
ATTENTION = {"einsum": einsum_attention, "xla": xla_attention, "dense": dense_attention}
