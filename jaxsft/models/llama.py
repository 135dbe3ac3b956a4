"""A Flax NNX decoder-only causal LM: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3 (text),
SmolLM3, Phi-3 and OLMo 2.

The Llama decoder, h += Attn(RMSNorm(h)); h += MLP(RMSNorm(h)), with RoPE, grouped-query
attention and a gated MLP, numerically following transformers' `modeling_llama` (RMSNorm and
RoPE tables in float32, attention softmax in float32), with the switches by which the other
families differ (`jaxsft.models.families`): where the norms sit, q/k norms, fused projections,
GeGLU, scaled embeddings, partial rotary, and per-layer windows and RoPE.

The decoder layers are ONE `DecoderLayer` whose parameters carry a leading layer axis (L, ...).
The forward pass runs `jax.lax.scan` over that axis, so XLA compiles a single layer body instead
of L unrolled copies: compile time stays near-constant in depth (important for compiling several
bucket shapes before training). `remat` wraps the scanned body in `jax.checkpoint` with a policy
of what each layer keeps for the backward pass (`DEFAULT_REMAT`).

Decoding uses the same layers with a `KVCache` (`CausalLM.init_cache`, `CausalLM.cached_hidden_states`):
the keys/values of new tokens are written into fixed cache slots and the queries attend over all
slots, so generation runs exactly the training layer math (masks, sliding window included).

Projections keep weights as `kernel` (in, out) (y = x @ kernel), i.e. the transpose of the
PyTorch `nn.Linear.weight`. LoRA factors, when `jaxsft.lora.apply_lora` adds them, live on the
projections as `nnx.LoRAParam` `lora_a` (in, r) and `lora_b` (r, out), also stacked per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxsft.models.families import (SUPPORTED_MODEL_TYPES, LlamaConfig, from_hf_config,  # noqa: F401
                                   to_hf_config)
from jaxsft.quant.kernel import kernel_value


def resolve_dtype(dtype) -> jnp.dtype:
  """The compute dtype: "auto" is bfloat16 on a GPU or TPU (LoRA params and optimizer state
  stay float32) and float32 on a CPU (no fast 16-bit matmuls there); any other name as given."""
  if isinstance(dtype, str) and dtype == "auto":
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
  return jnp.dtype(dtype)


# ---------------------------------------------------------------------------------------------
# RoPE, masks, attention


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
  Measured on the real SmolLM2 train step (2-core CPU, float32, head-major blocks): at T = 128,
  64 took 2.30 s against 2.32 s for 32 and 2.37 s for 128 (dense); at T = 256, 64 and 128 tied
  (2.44 s); at T = 512, 128 took 5.52 s against 5.64 s for 64 and 5.76 s for 256; at T = 1024,
  128 took 6.94 s against 7.29 s for 256 and 7.36 s for 64. Smaller blocks skip more of the
  upper triangle but cost more per computed pair."""
  return min(128, max(64, -(-length // 32) * 8))


def causal_block_attention(q, k, v, mask, scale, *, block: int | None, sliding_window: int | None):
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
  """
  b, t, n, d = q.shape
  kv_heads = k.shape[2]
  qh = q.reshape(b, t, kv_heads, n // kv_heads, d).transpose(0, 2, 3, 1, 4)
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  blocks = query_blocks(t, auto_causal_block(t) if block is None else block, sliding_window)
  out = _block_attention(qh, kh, vh, mask, float(scale), blocks)
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


def _block_attention_fwd(qh, kh, vh, mask, scale, blocks):
  """Softmax(Q Kᵀ · scale) V block by block; saves each query's row maximum and 1 / row sum."""
  b, kv_heads, groups, _, d = qh.shape
  outs, maxes, inv_sums = [], [], []
  for first_key, start, stop in blocks:
    scores = _block_scores(qh, kh, mask, scale, first_key, start, stop)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    exp = jnp.exp(scores - row_max)
    inv_sum = 1.0 / jnp.sum(exp, axis=-1, keepdims=True)
    probs = (exp * inv_sum).astype(vh.dtype).reshape(b, kv_heads, -1, stop - first_key)
    out = jnp.einsum("bkms,bksd->bkmd", probs, vh[:, :, first_key:stop])
    outs.append(out.reshape(b, kv_heads, groups, stop - start, d))
    maxes.append(row_max)
    inv_sums.append(inv_sum)
  # Named so that a layer's remat policy can keep them (`ATTENTION_RESIDUALS`): the backward
  # pass then needs no second forward pass through the attention.
  out, row_max, inv_sum = (checkpoint_name(jnp.concatenate(xs, axis=3), name)
                           for xs, name in zip((outs, maxes, inv_sums), ATTENTION_RESIDUALS))
  return out, (qh, kh, vh, mask, out, row_max, inv_sum)


def _block_attention_bwd(scale, blocks, residuals, d_out):
  """FlashAttention's backward pass, block by block, with P = exp(S - max) / sum recomputed
  from the saved row statistics and Δ = rowsum(dO ⊙ O) (= rowsum(dP ⊙ P)):
    dV = Pᵀ dO,   dS = P ⊙ (dO Vᵀ - Δ) · scale,   dQ = dS K,   dK = dSᵀ Q.
  dV and dK are computed transposed, (dOᵀ P)ᵀ and (Qᵀ dS)ᵀ, from (D, G·t) copies of the small
  operands: every product then contracts a minor axis of its first operand."""
  qh, kh, vh, mask, out, row_max, inv_sum = residuals
  b, kv_heads, groups, _, d = qh.shape
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
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
  return (dq.astype(qh.dtype), dk_t.swapaxes(2, 3).astype(kh.dtype), dv_t.swapaxes(2, 3).astype(vh.dtype), None)


_block_attention = jax.custom_vjp(lambda qh, kh, vh, mask, scale, blocks:
                                  _block_attention_fwd(qh, kh, vh, mask, scale, blocks)[0],
                                  nondiff_argnums=(4, 5))
_block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)


def cudnn_attention(q, k, v, mask, scale, *, sliding_window: int | None):
  """cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) for causal
  self-attention in 16-bit floats on an NVIDIA GPU: causal and window blocks are skipped by the
  kernel (`is_causal`, `local_window_size`), `mask` adds padding and packed segments."""
  window = None if sliding_window is None else (sliding_window - 1, 0)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                      local_window_size=window, implementation="cudnn")


def self_attention(q, k, v, mask, scale, *, block: int | None, sliding_window: int | None):
  """Causal self-attention (no cache) by the fastest path the backend offers.

  GPU with bfloat16/float16: cuDNN (`cudnn_attention`); anywhere else, or when cuDNN refuses
  the shapes while tracing: `causal_block_attention`.
  """
  if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
    try:
      return cudnn_attention(q, k, v, mask, scale, sliding_window=sliding_window)
    except (NotImplementedError, ValueError, RuntimeError):  # e.g. a head size cuDNN lacks
      pass
  return causal_block_attention(q, k, v, mask, scale, block=block, sliding_window=sliding_window)


def xla_attention(q, k, v, mask, scale):
  """The "xla" attention with a cache (decoding) or any non-causal mask: `dense_attention`."""
  return dense_attention(q, k, v, mask, scale)


# name -> attention over a KV cache / any mask. Without a cache, "xla" runs `self_attention`
# (causal block skipping, cuDNN on a GPU); "dense" always computes every pair.
ATTENTION = {"einsum": einsum_attention, "xla": xla_attention, "dense": dense_attention}

_policies = jax.checkpoint_policies
_keep_attention = _policies.save_only_these_names(*ATTENTION_RESIDUALS)
REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": _policies.save_from_both_policies(_policies.dots_saveable, _keep_attention),
    "dots_no_batch": _policies.save_from_both_policies(_policies.dots_with_no_batch_dims_saveable, _keep_attention),
    "nothing": _policies.nothing_saveable,
}
REMAT_CHOICES = ("none", *REMAT_POLICIES)
DEFAULT_REMAT = "dots_no_batch"
"""What a layer keeps by default: the projections' outputs and the attention's output with its
softmax row statistics (`ATTENTION_RESIDUALS`); norms, RoPE, SiLU and the attention scores are
recomputed in the backward pass instead of being stacked per layer. Measured on the real SmolLM2
LoRA step (2-core CPU, float32, medians of interleaved fresh processes): at 8x128 2.35 s against
2.37 s keeping every matmul output ("dots"); at 4x512 6.24 s against 6.37 s. Keeping the
attention's output too: 6.10 s against 6.42 s at 4x512 (8x128 unchanged, 2.67 s against 2.65 s).
Keeping everything ("none") made the 8x128 step 8-9% slower than keeping the matmul outputs."""


# ---------------------------------------------------------------------------------------------
# Modules. `stack` is the leading layer axis: () for a single layer, (L,) for the stacked decoder.


@jax.custom_vjp
def low_rank_product(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """(x @ a) @ b for x (..., in), a (in, r), b (r, out): the LoRA branch.

  Its backward pass is autodiff's, with the weight gradients' products written so that the
  transposed operand is the rank-r one:
    ∂a = xᵀ (g bᵀ),   ∂b = ((g)ᵀ (x a))ᵀ,   ∂x = (g bᵀ) aᵀ
  (autodiff writes ∂b = (x a)ᵀ g, for which XLA on a CPU transposes the (tokens, out) gradient
  g, fused with whatever produced it, before an unblocked product).
  """
  return (x @ a) @ b


def _low_rank_fwd(x, a, b):
  xa = x @ a
  return xa @ b, (x, a, b, xa)


def _low_rank_bwd(residuals, g):
  x, a, b, xa = residuals
  tokens = lambda t: t.reshape(-1, t.shape[-1])
  g_xa = g @ b.T
  contract_tokens = (((0,), (0,)), ((), ()))
  grad_a = jax.lax.dot_general(tokens(x), tokens(g_xa), contract_tokens)  # (in, r)
  grad_b = jax.lax.dot_general(tokens(g), tokens(xa), contract_tokens).T  # (out, r)ᵀ
  return g_xa @ a.T, grad_a.astype(a.dtype), grad_b.astype(b.dtype)


low_rank_product.defvjp(_low_rank_fwd, _low_rank_bwd)


class Linear(nnx.Module):
  """y = x @ kernel (+ bias) (+ scale * dropout(x) @ lora_a @ lora_b).

  LoRA factors are `nnx.LoRAParam`s set by `jaxsft.lora.apply_lora` (None when absent); they
  stay float32 and are cast to the compute dtype at use, like PEFT's autocast of adapters.
  """

  def __init__(self, in_features: int, out_features: int, *, bias: bool, stack: tuple[int, ...],
               dtype, rng_index: int, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.kernel = nnx.Param(init(rngs.params(), (*stack, in_features, out_features), dtype))
    self.bias = nnx.Param(jnp.zeros((*stack, out_features), dtype)) if bias else None
    # data (not static) attributes: `apply_lora` later puts LoRAParams here
    self.lora_a: nnx.LoRAParam | None = nnx.data(None)
    self.lora_b: nnx.LoRAParam | None = nnx.data(None)
    self.lora_scale = 0.0
    self.lora_dropout = 0.0
    self.rng_index = rng_index  # folds the layer's dropout key into a per-projection key

  def __call__(self, x: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
    y = x @ kernel_value(self.kernel, x.dtype)  # a quantized base is dequantized here (jaxsft.quant)
    if self.bias is not None:
      y = y + self.bias[...]
    if self.lora_a is not None:
      lora_x = x
      if dropout_rng is not None and self.lora_dropout > 0.0:
        keep = 1.0 - self.lora_dropout
        key = jax.random.fold_in(dropout_rng, self.rng_index)
        lora_x = jnp.where(jax.random.bernoulli(key, keep, x.shape), x / keep, 0).astype(x.dtype)
      a = self.lora_a[...].astype(x.dtype)
      b = self.lora_b[...].astype(x.dtype)
      y = y + low_rank_product(lora_x, a, b) * jnp.asarray(self.lora_scale, x.dtype)
    return y


class RMSNorm(nnx.Module):
  """w · (x / sqrt(mean(x²) + eps)), normalized in float32 (as HF). Three flavours, one per
  family convention: Llama casts the normalized x back before scaling; with `weight_float32`
  (OLMo 2) the scale multiplies in float32 and the product is cast; with `unit_offset` (Gemma)
  the scale is (1 + w), in float32, and w starts at 0."""

  def __init__(self, dim: int, eps: float, *, stack: tuple[int, ...], dtype, unit_offset: bool = False,
               weight_float32: bool = False):
    self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((*stack, dim), dtype))
    self.eps = eps
    self.unit_offset = unit_offset
    self.weight_float32 = weight_float32 or unit_offset

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if not self.weight_float32:
      return self.weight[...] * x32.astype(x.dtype)
    w = self.weight[...].astype(jnp.float32)
    return (x32 * (1.0 + w if self.unit_offset else w)).astype(x.dtype)


def _norm(config: LlamaConfig, dim: int, *, stack, dtype) -> RMSNorm:
  return RMSNorm(dim, config.rms_norm_eps, stack=stack, dtype=dtype, unit_offset=config.norm_unit_offset,
                 weight_float32=config.norm_weight_float32)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE; per family: q/k/v in one fused `qkv_proj`
  (Phi-3), RMSNorm on q and k per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2)."""

  def __init__(self, config: LlamaConfig, *, stack, dtype, attention: str, rngs: nnx.Rngs,
               causal_block: int | None = None, sliding_window: int | None = None):
    h, d = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    kw = dict(stack=stack, dtype=dtype, rngs=rngs)
    if config.fused_projections:
      self.qkv_proj = Linear(h, q_size + 2 * kv_size, bias=config.qkv_bias, rng_index=0, **kw)
    else:
      self.q_proj = Linear(h, q_size, bias=config.qkv_bias, rng_index=0, **kw)
      self.k_proj = Linear(h, kv_size, bias=config.qkv_bias, rng_index=1, **kw)
      self.v_proj = Linear(h, kv_size, bias=config.qkv_bias, rng_index=2, **kw)
    self.o_proj = Linear(q_size, h, bias=config.o_bias, rng_index=3, **kw)
    self.qk_norm = config.qk_norm
    if config.qk_norm is not None:
      per_head = config.qk_norm == "head"
      self.q_norm = _norm(config, d if per_head else q_size, stack=stack, dtype=dtype)
      self.k_norm = _norm(config, d if per_head else kv_size, stack=stack, dtype=dtype)
    self.fused = config.fused_projections
    self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
    self.scale = config.attention_scale
    self.attention = attention
    self.causal_block = causal_block
    # static window for block skipping / cuDNN: the layers' common window (with windows that
    # differ between layers the mask carries each layer's own)
    self.sliding_window = sliding_window

  def project(self, x, dropout_rng=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q (B, t, N, D), k and v (B, t, K, D), before RoPE (q/k norms applied)."""
    b, t, _ = x.shape
    q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    if self.fused:
      qkv = self.qkv_proj(x, dropout_rng)
      q, k, v = qkv[..., :q_size], qkv[..., q_size:q_size + kv_size], qkv[..., q_size + kv_size:]
    else:
      q, k, v = self.q_proj(x, dropout_rng), self.k_proj(x, dropout_rng), self.v_proj(x, dropout_rng)
    if self.qk_norm == "projection":
      q, k = self.q_norm(q), self.k_norm(k)
    q = q.reshape(b, t, self.num_heads, self.head_dim)
    k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
    v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.qk_norm == "head":
      q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v

  def __call__(self, x, cos, sin, mask, dropout_rng=None, cache: KVCache | None = None,
               cache_start=0) -> tuple[jax.Array, KVCache | None]:
    """(output (B, t, H), updated cache or None).

    Without a cache the queries attend over the t keys of `x` (`mask` (B, 1, t, t)). With one,
    the new keys/values go to cache slots [cache_start, cache_start + t) first and the queries
    attend over all S slots (`mask` (B, 1, t, S), see `cache_attention_mask`).
    """
    b, t, _ = x.shape
    q, k, v = self.project(x, dropout_rng)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:
      cache = cache.write(k, v, cache_start)
      out = ATTENTION[self.attention](q, cache.keys, cache.values, mask, self.scale)
    elif self.attention == "xla":  # causal self-attention: `mask` is causal (attention_mask_4d)
      out = self_attention(q, k, v, mask, self.scale, block=self.causal_block, sliding_window=self.sliding_window)
    else:
      out = ATTENTION[self.attention](q, k, v, mask, self.scale)
    return self.o_proj(out.reshape(b, t, -1), dropout_rng), cache


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
  """Gated MLP: down(act(gate(x)) * up(x)); act is SiLU (SwiGLU) or tanh-GELU (GeGLU), gate
  and up are one fused `gate_up_proj` (gate first) for Phi-3."""

  def __init__(self, config: LlamaConfig, *, stack, dtype, rngs: nnx.Rngs):
    h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
    kw = dict(bias=bias, stack=stack, dtype=dtype, rngs=rngs)
    if config.fused_projections:
      self.gate_up_proj = Linear(h, 2 * i, rng_index=4, **kw)
    else:
      self.gate_proj = Linear(h, i, rng_index=4, **kw)
      self.up_proj = Linear(h, i, rng_index=5, **kw)
    self.down_proj = Linear(i, h, rng_index=6, **kw)
    self.fused = config.fused_projections
    self.act = config.hidden_act

  def __call__(self, x, dropout_rng=None):
    if self.fused:
      gate, up = jnp.split(self.gate_up_proj(x, dropout_rng), 2, axis=-1)
    else:
      gate, up = self.gate_proj(x, dropout_rng), self.up_proj(x, dropout_rng)
    return self.down_proj(_ACTIVATIONS[self.act](gate) * up, dropout_rng)


class DecoderLayer(nnx.Module):
  """One decoder layer; the norms sit where the family puts them (`norm_placement`):

    pre (Llama):       h += attn(input_ln(h));                 h += mlp(post_attention_ln(h))
    post (OLMo 2):     h += post_attention_ln(attn(h));        h += post_feedforward_ln(mlp(h))
    sandwich (Gemma):  h += post_attention_ln(attn(input_ln(h)));
                       h += post_feedforward_ln(mlp(pre_feedforward_ln(h)))

  (the attribute names are transformers' for each family, so weights map by name).
  """

  def __init__(self, config: LlamaConfig, *, stack, dtype, attention: str, rngs: nnx.Rngs,
               causal_block: int | None = None, sliding_window: int | None = None):
    norm = functools.partial(_norm, config, config.hidden_size, stack=stack, dtype=dtype)
    self.placement = config.norm_placement
    if self.placement != "post":
      self.input_layernorm = norm()
    self.self_attn = Attention(config, stack=stack, dtype=dtype, attention=attention, rngs=rngs,
                               causal_block=causal_block, sliding_window=sliding_window)
    self.post_attention_layernorm = norm()
    if self.placement == "sandwich":
      self.pre_feedforward_layernorm = norm()
    if self.placement != "pre":
      self.post_feedforward_layernorm = norm()
    self.mlp = MLP(config, stack=stack, dtype=dtype, rngs=rngs)

  def __call__(self, h, cos, sin, mask, dropout_rng=None, cache: KVCache | None = None,
               cache_start=0) -> tuple[jax.Array, KVCache | None]:
    """(new hidden states, updated cache or None): see `Attention.__call__` for the cache."""
    attn_in = h if self.placement == "post" else self.input_layernorm(h)
    attn_out, cache = self.self_attn(attn_in, cos, sin, mask, dropout_rng, cache, cache_start)
    if self.placement == "pre":
      h = h + attn_out
      return h + self.mlp(self.post_attention_layernorm(h), dropout_rng), cache
    h = h + self.post_attention_layernorm(attn_out)
    mlp_in = self.pre_feedforward_layernorm(h) if self.placement == "sandwich" else h
    return h + self.post_feedforward_layernorm(self.mlp(mlp_in, dropout_rng)), cache


def _variants(values: tuple) -> tuple[tuple, tuple[int, ...] | None]:
  """(distinct values in first-seen order, per-layer index into them, or None when all agree)."""
  distinct = tuple(dict.fromkeys(values))
  if len(distinct) == 1:
    return distinct, None
  return distinct, tuple(distinct.index(v) for v in values)


class CausalLM(nnx.Module):
  """Decoder-only causal LM of any supported family (`jaxsft.models.families`).
  `model(input_ids, ...) -> logits (B, T, V)` in the compute dtype.

  Args:
    config: the architecture.
    dtype: parameter and compute dtype (float32, bfloat16, or "auto": see `resolve_dtype`).
      LoRA params stay float32.
    attention: "xla" (causal self-attention by `self_attention`: head-major query blocks that
      skip the keys above the diagonal, cuDNN on a GPU in 16-bit; with a KV cache
      `jax.nn.dot_product_attention`), "dense" (`jax.nn.dot_product_attention`, every pair
      computed) or "einsum" (a plain reference).
    remat: "none" or None (keep everything JAX saves), a name in `REMAT_POLICIES` (default
      `DEFAULT_REMAT`), or a `jax.checkpoint` policy callable: recompute
      each layer in the backward pass (less activation memory for long sequences).
    causal_block: query block size of the causal block skipping ("xla" on CPU); None:
      `auto_causal_block` of each sequence length.

  Layers that differ (a window or not, their RoPE base, RoPE or none) stay one scanned layer:
  the decoder builds each distinct mask and RoPE table once and hands every layer, as a scanned
  index, the one it uses.
  """

  def __init__(self, config: LlamaConfig, *, dtype="float32", attention: str = "xla",
               remat: str | Callable | None = DEFAULT_REMAT, causal_block: int | None = None, rngs: nnx.Rngs):
    if attention not in ATTENTION:
      raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {attention!r}")
    if isinstance(remat, str) and remat not in REMAT_CHOICES:
      raise ValueError(f"remat must be None, a callable or one of {list(REMAT_CHOICES)}, got {remat!r}")
    dtype = resolve_dtype(dtype)
    self.config = config
    self.dtype = dtype
    self.remat = remat
    self.windows, self.window_index = _variants(config.layer_windows())
    self.rope_kinds, self.rope_index = _variants(config.layer_rope_kinds())
    self.embed_tokens = nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (config.vocab_size, config.hidden_size), dtype))
    self.layers = DecoderLayer(config, stack=(config.num_layers,), dtype=dtype, attention=attention,
                               rngs=rngs, causal_block=causal_block,
                               sliding_window=self.windows[0] if self.window_index is None else None)
    self.norm = _norm(config, config.hidden_size, stack=(), dtype=dtype)
    self.lm_head = None if config.tie_word_embeddings else nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (config.vocab_size, config.hidden_size), dtype))

  def output_embedding(self) -> jax.Array:
    """(V, H): the LM head (the input embedding when tied)."""
    return (self.embed_tokens if self.lm_head is None else self.lm_head)[...]

  def hidden_states(self, input_ids, attention_mask=None, positions=None, segment_ids=None, *,
                    dropout_rng=None) -> jax.Array:
    """Final-normed hidden states (B, T, H) in the compute dtype."""
    input_ids = jnp.asarray(input_ids)
    b, t = input_ids.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    masks = [attention_mask_4d(b, t, attention_mask, segment_ids, w) for w in self.windows]
    h, _ = self._decoder(input_ids, positions, masks, dropout_rng=dropout_rng)
    return h

  def init_cache(self, batch_size: int, num_slots: int) -> KVCache:
    """An empty (zero) cache of `num_slots` slots for every layer, in the compute dtype."""
    cfg = self.config
    shape = (cfg.num_layers, batch_size, num_slots, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

  def cached_hidden_states(self, input_ids, positions, cache: KVCache, cache_start,
                           key_mask) -> tuple[jax.Array, KVCache]:
    """Final-normed hidden states (B, t, H) of t new tokens and the cache holding their keys.

    The tokens (at RoPE `positions` (B, t)) take cache slots [cache_start, cache_start + t);
    `key_mask` (B, S) marks the slots a query may see (0: padding). Causality and the sliding
    window are counted in slots, see `cache_attention_mask`.
    """
    input_ids = jnp.asarray(input_ids)
    masks = [cache_attention_mask(cache_start, input_ids.shape[1], jnp.asarray(key_mask), w)
             for w in self.windows]
    return self._decoder(input_ids, positions, masks, cache=cache, cache_start=cache_start)

  def embed(self, input_ids) -> jax.Array:
    """Input embeddings (B, T, H); Gemma scales them by √hidden (in the compute dtype, as HF)."""
    h = jnp.take(self.embed_tokens[...], input_ids, axis=0)
    if self.config.scale_embeddings:
      h = h * jnp.asarray(self.config.hidden_size ** 0.5, jnp.float32).astype(h.dtype)
    return h

  def _decoder(self, input_ids, positions, masks, *, dropout_rng=None, cache: KVCache | None = None,
               cache_start=0) -> tuple[jax.Array, KVCache | None]:
    """Embed, run the scanned layer stack, final norm: (hidden states, updated cache or None).

    `masks` holds one mask per distinct window (`self.windows`); with several, each layer picks
    its own by a scanned index, and so with RoPE tables (`self.rope_kinds`)."""
    positions = jnp.asarray(positions)
    tables = [rope_tables(positions, rope_inv_freq(self.config, kind), self.dtype, rotary_dim=self.config.rotary_dim)
              for kind in self.rope_kinds]
    h = self.embed(input_ids)

    graphdef, layer_state = nnx.split(self.layers)
    keys = None if dropout_rng is None else jax.random.split(dropout_rng, self.config.num_layers)
    if self.rope_index is None:
      (cos, sin), = tables
    else:
      cos_all, sin_all = jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables])
    mask_all = masks[0] if self.window_index is None else jnp.stack(masks)
    rope_index = None if self.rope_index is None else jnp.asarray(self.rope_index, jnp.int32)
    window_index = None if self.window_index is None else jnp.asarray(self.window_index, jnp.int32)

    # `keys`, `cache` and the indices may be None (empty pytrees): the scan then carries nothing for them.
    def layer_step(h, xs):
      state, key, layer_cache, r, w = xs
      layer_cos, layer_sin = (cos, sin) if r is None else (cos_all[r], sin_all[r])
      mask = mask_all if w is None else mask_all[w]
      return nnx.merge(graphdef, state)(h, layer_cos, layer_sin, mask, key, layer_cache, cache_start)

    if self.remat not in (None, "none"):
      policy = REMAT_POLICIES[self.remat] if isinstance(self.remat, str) else self.remat
      layer_step = jax.checkpoint(layer_step, policy=policy, prevent_cse=False)
    h, cache = jax.lax.scan(layer_step, h, (layer_state, keys, cache, rope_index, window_index))
    return self.norm(h), cache

  def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None, *,
               dropout_rng=None) -> jax.Array:
    """Logits (B, T, V) in the compute dtype (the loss upcasts to float32)."""
    h = self.hidden_states(input_ids, attention_mask, positions, segment_ids, dropout_rng=dropout_rng)
    return h @ self.output_embedding().T


Llama = CausalLM


def init_random(config: LlamaConfig, *, dtype="float32", seed: int = 0, **kwargs) -> CausalLM:
  """A randomly initialized model (tests, benchmarks)."""
  return CausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed), **kwargs)


def from_hf_state_dict(config: LlamaConfig, tensors: Mapping[str, np.ndarray], *, dtype="float32",
                       source: str = "state dict", **kwargs) -> CausalLM:
  """Build a `CausalLM` from Hugging Face named weights (`model.layers.0.self_attn.q_proj.weight`, ...).

  Every expected tensor must be present with the HF shape and every given tensor must be used
  (rotary buffers excepted): a mismatch is an error naming the tensor and `source`.
  """
  dtype = resolve_dtype(dtype)
  model = nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0), **kwargs))
  used: set[str] = set()

  def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise KeyError(f"{source}: missing tensor {name!r} (expected shape {shape}) for {config.architecture}")
    value = np.asarray(tensors[name])
    if value.shape != shape:
      raise ValueError(f"{source}: tensor {name!r} has shape {value.shape}, expected {shape} "
                       f"for {config.architecture} (another model?)")
    used.add(name)
    return value

  def assign(variable: nnx.Variable, value: np.ndarray):
    variable.set_value(jnp.asarray(value, dtype))

  h, v = config.hidden_size, config.vocab_size
  assign(model.embed_tokens, take("model.embed_tokens.weight", (v, h)))
  assign(model.norm.weight, take("model.norm.weight", (h,)))
  if model.lm_head is not None:
    assign(model.lm_head, take("lm_head.weight", (v, h)))
  elif "lm_head.weight" in tensors:
    used.add("lm_head.weight")  # tied: a saved copy of the embedding is redundant

  for path, variable in nnx.iter_graph(model.layers):
    if not isinstance(variable, nnx.Param) or isinstance(variable, nnx.LoRAParam):
      continue
    module_path = ".".join(str(p) for p in path[:-1])
    leaf = path[-1]
    per_layer_shape = tuple(variable.shape[1:])
    if leaf == "kernel":  # (in, out) here, (out, in) in PyTorch
      hf_shape = per_layer_shape[::-1]
      values = [take(f"model.layers.{i}.{module_path}.weight", hf_shape).T for i in range(config.num_layers)]
    else:  # bias, norm weight
      values = [take(f"model.layers.{i}.{module_path}.{leaf}", per_layer_shape)
                for i in range(config.num_layers)]
    assign(variable, np.stack(values))

  unused = sorted(k for k in tensors if k not in used and not k.endswith("rotary_emb.inv_freq"))
  if unused:
    raise ValueError(f"{source}: tensors not used by {config.architecture}: {unused[:8]}"
                     f"{' ...' if len(unused) > 8 else ''}")
  return model


def to_hf_state_dict(model: CausalLM) -> dict[str, np.ndarray]:
  """The inverse of `from_hf_state_dict` (base weights only; merge LoRA first to export it)."""
  config = model.config
  out = {"model.embed_tokens.weight": np.asarray(model.embed_tokens[...]),
         "model.norm.weight": np.asarray(model.norm.weight[...])}
  if model.lm_head is not None:
    out["lm_head.weight"] = np.asarray(model.lm_head[...])
  for path, variable in nnx.iter_graph(model.layers):
    if not isinstance(variable, nnx.Param) or isinstance(variable, nnx.LoRAParam):
      continue
    module_path = ".".join(str(p) for p in path[:-1])
    leaf = path[-1]
    stacked = np.asarray(variable[...])
    for i in range(config.num_layers):
      if leaf == "kernel":
        out[f"model.layers.{i}.{module_path}.weight"] = np.ascontiguousarray(stacked[i].T)
      else:
        out[f"model.layers.{i}.{module_path}.{leaf}"] = stacked[i]
  return out
