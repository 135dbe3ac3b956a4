"""A Flax NNX causal LM for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2.

Pre-norm decoder: h += Attn(RMSNorm(h)); h += MLP(RMSNorm(h)), with RoPE, grouped-query
attention and a SwiGLU MLP, numerically following transformers' `modeling_llama` (RMSNorm and
RoPE tables in float32, attention softmax in float32).

The decoder layers are ONE `DecoderLayer` whose parameters carry a leading layer axis (L, ...).
The forward pass runs `jax.lax.scan` over that axis, so XLA compiles a single layer body instead
of L unrolled copies: compile time stays near-constant in depth (important for compiling several
bucket shapes before training). `remat` wraps the scanned body in `jax.checkpoint`.

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

# transformers `model_type` -> (architecture name, q/k/v bias forced on). Anything else is refused.
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM"}
_SUPPORTED_ROPE = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The architecture. Hashable (it is static data of the model's graph)."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  # Llama-3 rope scaling as sorted (key, value) pairs, e.g. (("factor", 8.0), ...); None: plain RoPE.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  sliding_window: int | None = None
  model_type: str = "llama"
  max_position_embeddings: int = 2048
  bos_token_id: int | None = None
  eos_token_id: int | list[int] | None = None
  pad_token_id: int | None = None

  @property
  def architecture(self) -> str:
    return SUPPORTED_MODEL_TYPES[self.model_type]


def _get(cfg: Mapping[str, Any], *keys, default=None):
  for k in keys:
    if cfg.get(k) is not None:
      return cfg[k]
  return default


def from_hf_config(hf_config) -> LlamaConfig:
  """A `LlamaConfig` from a transformers config object or a `config.json` dict.

  Accepts both the transformers 4 keys (`rope_theta`, `rope_scaling`) and the transformers 5
  `rope_parameters`. Raises `ValueError` naming the architecture when it is not supported.
  """
  cfg = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
  model_type = cfg.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    archs = cfg.get("architectures") or []
    raise ValueError(
        f"unsupported architecture: model_type={model_type!r} architectures={archs}; jaxsft supports "
        f"{sorted(SUPPORTED_MODEL_TYPES)} ({', '.join(SUPPORTED_MODEL_TYPES.values())})")
  for arch in cfg.get("architectures") or []:
    if arch != SUPPORTED_MODEL_TYPES[model_type]:
      raise ValueError(f"unsupported architecture {arch!r} (model_type {model_type!r}): jaxsft builds "
                       f"causal LMs only ({SUPPORTED_MODEL_TYPES[model_type]})")
  if cfg.get("hidden_act", "silu") != "silu":
    raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} for {model_type}: only silu (SwiGLU)")

  rope = dict(_get(cfg, "rope_parameters", default={}) or {})
  legacy_scaling = cfg.get("rope_scaling") or {}
  rope.update({k: v for k, v in legacy_scaling.items() if k not in rope})
  rope_theta = float(_get(rope, "rope_theta", default=_get(cfg, "rope_theta", default=10000.0)))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in _SUPPORTED_ROPE:
    raise ValueError(f"unsupported rope type {rope_type!r} for {model_type}: jaxsft supports {_SUPPORTED_ROPE}")
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"unsupported partial_rotary_factor {rope['partial_rotary_factor']} for {model_type}")
  rope_scaling = None
  if rope_type == "llama3":
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope]
    if missing:
      raise ValueError(f"llama3 rope scaling is missing {missing} in the config")
    rope_scaling = tuple((k, float(rope[k])) for k in keys)

  num_heads = int(cfg["num_attention_heads"])
  hidden = int(cfg["hidden_size"])
  qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
  sliding_window = None
  if model_type == "qwen2":
    qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v biases, never an o_proj bias
    if cfg.get("use_sliding_window"):
      raise ValueError("unsupported: Qwen2 with use_sliding_window=True (per-layer sliding windows)")
  if model_type == "mistral":
    sliding_window = cfg.get("sliding_window")
  return LlamaConfig(
      vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
      intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
      num_heads=num_heads, num_kv_heads=int(_get(cfg, "num_key_value_heads", default=num_heads)),
      head_dim=int(_get(cfg, "head_dim", default=hidden // num_heads)),
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
      rope_scaling=rope_scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
      sliding_window=None if sliding_window is None else int(sliding_window), model_type=model_type,
      max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
      bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
      pad_token_id=cfg.get("pad_token_id"))


def to_hf_config(config: LlamaConfig) -> dict[str, Any]:
  """The `config.json` dict transformers reads back into the same architecture."""
  out = {
      "architectures": [config.architecture], "model_type": config.model_type,
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu",
      "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_word_embeddings,
      "max_position_embeddings": config.max_position_embeddings,
      "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
      "pad_token_id": config.pad_token_id,
  }
  if config.rope_scaling:
    out["rope_scaling"] = {"rope_type": "llama3", **dict(config.rope_scaling)}
  if config.model_type == "llama":
    out.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
  if config.model_type == "mistral":
    out["sliding_window"] = config.sliding_window
  return out


def resolve_dtype(dtype) -> jnp.dtype:
  """The compute dtype: "auto" is bfloat16 on a GPU or TPU (LoRA params and optimizer state
  stay float32) and float32 on a CPU (no fast 16-bit matmuls there); any other name as given."""
  if isinstance(dtype, str) and dtype == "auto":
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
  return jnp.dtype(dtype)


# ---------------------------------------------------------------------------------------------
# RoPE, masks, attention


@functools.lru_cache(maxsize=16)
def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
  """Inverse frequencies θ^(-2i/d), float32 like transformers (Llama-3 scaling applied)."""
  dim = config.head_dim
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
  if config.rope_scaling is None:
    return inv_freq
  s = dict(config.rope_scaling)
  factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
  old_len = s["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
  """cos, sin of shape (B, T, 1, D) (rotate-half layout: frequencies repeated twice)."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x * cos + rotate_half(x) * sin on (B, T, heads, D)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


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


def causal_block_attention(q, k, v, mask, scale, *, block: int, sliding_window: int | None):
  """`dense_attention` of causal self-attention, query block by query block, over only the keys
  a block can see: [max(0, start - window + 1), stop) for queries [start, stop).

  The key blocks above the diagonal (and, with a window, those behind it) are never computed:
  for T = n·block that is (n + 1) / 2n of the dense work, e.g. 36/64 at T = 512, block 64.
  `mask` (B, 1, T, T) still applies inside each block (padding, packed segments), so the
  result is the dense one whenever `mask` is causal (and windowed by `sliding_window`).
  """
  t = q.shape[1]
  if t <= block:
    return dense_attention(q, k, v, mask, scale)
  outs = []
  for start in range(0, t, block):
    stop = min(start + block, t)
    first_key = 0 if sliding_window is None else max(0, start - sliding_window + 1)
    outs.append(dense_attention(q[:, start:stop], k[:, first_key:stop], v[:, first_key:stop],
                                mask[:, :, start:stop, first_key:stop], scale))
  return jnp.concatenate(outs, axis=1)


def cudnn_attention(q, k, v, mask, scale, *, sliding_window: int | None):
  """cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) for causal
  self-attention in 16-bit floats on an NVIDIA GPU: causal and window blocks are skipped by the
  kernel (`is_causal`, `local_window_size`), `mask` adds padding and packed segments."""
  window = None if sliding_window is None else (sliding_window - 1, 0)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                      local_window_size=window, implementation="cudnn")


def self_attention(q, k, v, mask, scale, *, block: int, sliding_window: int | None):
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

REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
}


# ---------------------------------------------------------------------------------------------
# Modules. `stack` is the leading layer axis: () for a single layer, (L,) for the stacked decoder.


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
    y = x @ self.kernel[...]
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
      y = y + ((lora_x @ a) @ b) * jnp.asarray(self.lora_scale, x.dtype)
    return y


class RMSNorm(nnx.Module):
  """weight * (x / sqrt(mean(x²) + eps)), normalized in float32, then cast back (as HF)."""

  def __init__(self, dim: int, eps: float, *, stack: tuple[int, ...], dtype):
    self.weight = nnx.Param(jnp.ones((*stack, dim), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * x32.astype(x.dtype)


class Attention(nnx.Module):

  def __init__(self, config: LlamaConfig, *, stack, dtype, attention: str, rngs: nnx.Rngs,
               causal_block: int = 64):
    h, d = config.hidden_size, config.head_dim
    kw = dict(stack=stack, dtype=dtype, rngs=rngs)
    self.q_proj = Linear(h, config.num_heads * d, bias=config.qkv_bias, rng_index=0, **kw)
    self.k_proj = Linear(h, config.num_kv_heads * d, bias=config.qkv_bias, rng_index=1, **kw)
    self.v_proj = Linear(h, config.num_kv_heads * d, bias=config.qkv_bias, rng_index=2, **kw)
    self.o_proj = Linear(config.num_heads * d, h, bias=config.o_bias, rng_index=3, **kw)
    self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
    self.attention = attention
    self.causal_block = causal_block
    self.sliding_window = config.sliding_window

  def __call__(self, x, cos, sin, mask, dropout_rng=None, cache: KVCache | None = None,
               cache_start=0) -> tuple[jax.Array, KVCache | None]:
    """(output (B, t, H), updated cache or None).

    Without a cache the queries attend over the t keys of `x` (`mask` (B, 1, t, t)). With one,
    the new keys/values go to cache slots [cache_start, cache_start + t) first and the queries
    attend over all S slots (`mask` (B, 1, t, S), see `cache_attention_mask`).
    """
    b, t, _ = x.shape
    q = self.q_proj(x, dropout_rng).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x, dropout_rng).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x, dropout_rng).reshape(b, t, self.num_kv_heads, self.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scale = self.head_dim ** -0.5
    if cache is not None:
      cache = cache.write(k, v, cache_start)
      out = ATTENTION[self.attention](q, cache.keys, cache.values, mask, scale)
    elif self.attention == "xla":  # causal self-attention: `mask` is causal (attention_mask_4d)
      out = self_attention(q, k, v, mask, scale, block=self.causal_block, sliding_window=self.sliding_window)
    else:
      out = ATTENTION[self.attention](q, k, v, mask, scale)
    return self.o_proj(out.reshape(b, t, -1), dropout_rng), cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: LlamaConfig, *, stack, dtype, rngs: nnx.Rngs):
    h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
    kw = dict(bias=bias, stack=stack, dtype=dtype, rngs=rngs)
    self.gate_proj = Linear(h, i, rng_index=4, **kw)
    self.up_proj = Linear(h, i, rng_index=5, **kw)
    self.down_proj = Linear(i, h, rng_index=6, **kw)

  def __call__(self, x, dropout_rng=None):
    return self.down_proj(jax.nn.silu(self.gate_proj(x, dropout_rng)) * self.up_proj(x, dropout_rng),
                          dropout_rng)


class DecoderLayer(nnx.Module):

  def __init__(self, config: LlamaConfig, *, stack, dtype, attention: str, rngs: nnx.Rngs,
               causal_block: int = 64):
    eps = config.rms_norm_eps
    self.input_layernorm = RMSNorm(config.hidden_size, eps, stack=stack, dtype=dtype)
    self.self_attn = Attention(config, stack=stack, dtype=dtype, attention=attention, rngs=rngs,
                               causal_block=causal_block)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, stack=stack, dtype=dtype)
    self.mlp = MLP(config, stack=stack, dtype=dtype, rngs=rngs)

  def __call__(self, h, cos, sin, mask, dropout_rng=None, cache: KVCache | None = None,
               cache_start=0) -> tuple[jax.Array, KVCache | None]:
    """(new hidden states, updated cache or None): see `Attention.__call__` for the cache."""
    attn_out, cache = self.self_attn(self.input_layernorm(h), cos, sin, mask, dropout_rng, cache, cache_start)
    h = h + attn_out
    return h + self.mlp(self.post_attention_layernorm(h), dropout_rng), cache


class CausalLM(nnx.Module):
  """Llama-family causal LM. `model(input_ids, ...) -> logits (B, T, V)` in the compute dtype.

  Args:
    config: the architecture.
    dtype: parameter and compute dtype (float32, bfloat16, or "auto": see `resolve_dtype`).
      LoRA params stay float32.
    attention: "xla" (`jax.nn.dot_product_attention`; causal self-attention skips the key
      blocks above the diagonal, see `self_attention`, and runs cuDNN on a GPU in 16-bit),
      "dense" (the same API, every pair computed) or "einsum" (a plain reference).
    remat: None, a name in `REMAT_POLICIES`, or a `jax.checkpoint` policy callable: recompute
      each layer in the backward pass (less activation memory for long sequences).
    causal_block: query block size of the causal block skipping ("xla" on CPU).
  """

  def __init__(self, config: LlamaConfig, *, dtype="float32", attention: str = "xla",
               remat: str | Callable | None = None, causal_block: int = 64, rngs: nnx.Rngs):
    if attention not in ATTENTION:
      raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {attention!r}")
    if isinstance(remat, str) and remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be None, a callable or one of {sorted(REMAT_POLICIES)}, got {remat!r}")
    dtype = resolve_dtype(dtype)
    self.config = config
    self.dtype = dtype
    self.remat = remat
    self.embed_tokens = nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (config.vocab_size, config.hidden_size), dtype))
    self.layers = DecoderLayer(config, stack=(config.num_layers,), dtype=dtype, attention=attention,
                               rngs=rngs, causal_block=causal_block)
    self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, stack=(), dtype=dtype)
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
    mask = attention_mask_4d(b, t, attention_mask, segment_ids, self.config.sliding_window)
    h, _ = self._decoder(input_ids, positions, mask, dropout_rng=dropout_rng)
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
    mask = cache_attention_mask(cache_start, input_ids.shape[1], jnp.asarray(key_mask),
                                self.config.sliding_window)
    return self._decoder(input_ids, positions, mask, cache=cache, cache_start=cache_start)

  def _decoder(self, input_ids, positions, mask, *, dropout_rng=None, cache: KVCache | None = None,
               cache_start=0) -> tuple[jax.Array, KVCache | None]:
    """Embed, run the scanned layer stack, final norm: (hidden states, updated cache or None)."""
    cos, sin = rope_tables(jnp.asarray(positions), rope_inv_freq(self.config), self.dtype)
    h = jnp.take(self.embed_tokens[...], input_ids, axis=0)

    graphdef, layer_state = nnx.split(self.layers)
    keys = None if dropout_rng is None else jax.random.split(dropout_rng, self.config.num_layers)

    # `keys` and `cache` may be None (empty pytrees): the scan then carries nothing for them.
    def layer_step(h, xs):
      state, key, layer_cache = xs
      return nnx.merge(graphdef, state)(h, cos, sin, mask, key, layer_cache, cache_start)

    if self.remat is not None:
      policy = REMAT_POLICIES[self.remat] if isinstance(self.remat, str) else self.remat
      layer_step = jax.checkpoint(layer_step, policy=policy, prevent_cse=False)
    h, cache = jax.lax.scan(layer_step, h, (layer_state, keys, cache))
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
