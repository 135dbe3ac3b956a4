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

Its parts live beside it: the projections with their LoRA and DoRA branches in
`jaxsft.models.linear`, RoPE in `jaxsft.models.rope`, the masks, the KV cache and the attention
paths in `jaxsft.models.attention`, the mapping to and from Hugging Face weights in
`jaxsft.models.hf_weights`, the configuration of every family in `jaxsft.models.families`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsft import matmul as matmul_lib
from jaxsft.matmul import matmul_t
from jaxsft.models.attention import (ATTENTION, ATTENTION_RESIDUALS, KVCache, attention_mask_4d,
                                     cache_attention_mask, self_attention)
from jaxsft.models.families import LlamaConfig
from jaxsft.models.linear import Linear
from jaxsft.models import stack16
from jaxsft.models.rope import apply_rope, rope_inv_freq, rope_tables
from jaxsft.quant.kernel import table_rows, table_value


def resolve_dtype(dtype) -> jnp.dtype:
  """The compute dtype: "auto" is bfloat16 on a GPU or TPU (LoRA params and optimizer state
  stay float32) and float32 on a CPU (no fast 16-bit matmuls there); any other name as given."""
  if isinstance(dtype, str) and dtype == "auto":
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
  return jnp.dtype(dtype)


def activation_dtype(dtype) -> jnp.dtype:
  """The dtype of the activations between the weight products, for weights in `dtype`: the
  same, except 16-bit weights on a CPU, whose activations stay float32 (XLA's CPU backend computes
  16-bit elementwise ops in float32 anyway, converting at every op; the products run on the
  CPU's bfloat16 kernels where it has bf16 units, in float32 elsewhere: see `jaxsft.matmul`)."""
  dtype = jnp.dtype(dtype)
  if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and jax.default_backend() == "cpu":
    return jnp.dtype(jnp.float32)
  return dtype


# ---------------------------------------------------------------------------------------------
# What each layer keeps for the backward pass (`CausalLM(remat=...)`, `model.remat`).

_policies = jax.checkpoint_policies
# 16-bit products on a CPU are a custom_vjp (jaxsft.matmul), kept by name, not as dots
_keep_attention = _policies.save_only_these_names(*ATTENTION_RESIDUALS, matmul_lib.PRODUCT)
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
recomputed in the backward pass instead of being stacked per layer, which costs more than the
recomputation (benchmarks/results/performance_notes.md: "The train step's design, as measured")."""


# ---------------------------------------------------------------------------------------------
# Modules. `stack` is the leading layer axis: () for a single layer, (L,) for the stacked decoder.


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
    self.weight_dtype = jnp.dtype(dtype)
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
      out = self_attention(q, k, v, mask, self.scale, block=self.causal_block, sliding_window=self.sliding_window,
                           operand_dtype=matmul_lib.product_dtype(q.dtype, self.weight_dtype))
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


def with_layers_packed(state):
  """A `CausalLM`'s state (`nnx.split`, or the part of it that holds the frozen base) with its
  16-bit layer stacks packed once (`stack16.prepacked`) on a CPU, for calls that read the same
  weights many times (each train step, each generated token): the forward then slices them without
  packing them again. Elsewhere, as it is. `with_layers_unpacked` undoes it."""
  if jax.default_backend() != "cpu" or "layers" not in state:
    return state
  state = nnx.State(dict(state))
  state["layers"] = stack16.prepacked(state["layers"])
  return state


def with_layers_unpacked(state):
  """`with_layers_packed`'s inverse: the state with plain 16-bit stacks again (a model to save,
  export or merge); a state with nothing packed comes back as it is."""
  if "layers" not in state:
    return state
  state = nnx.State(dict(state))
  state["layers"] = stack16.unpacked(state["layers"])
  return state


class CausalLM(nnx.Module):
  """Decoder-only causal LM of any supported family (`jaxsft.models.families`).
  `model(input_ids, ...) -> logits (B, T, V)` in the activation dtype (`activation_dtype`).

  Args:
    config: the architecture.
    dtype: parameter and compute dtype (float32, bfloat16, or "auto": see `resolve_dtype`); on a
      CPU, 16-bit weights keep float32 activations between the products (`activation_dtype`).
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
    self.activation_dtype = activation_dtype(dtype)
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
    """(V, H): the LM head (the input embedding when tied), dequantized when quantized."""
    return table_value(self.embed_tokens if self.lm_head is None else self.lm_head, self.dtype)

  def hidden_states(self, input_ids, attention_mask=None, positions=None, segment_ids=None, *,
                    dropout_rng=None, embeddings_hook=None) -> jax.Array:
    """Final-normed hidden states (B, T, H) in the activation dtype.

    `embeddings_hook`: a function applied to the input embeddings (B, T, H) before the first
    layer (the training step's NEFTune noise); None: the embeddings as they are."""
    input_ids = jnp.asarray(input_ids)
    b, t = input_ids.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    masks = [attention_mask_4d(b, t, attention_mask, segment_ids, w) for w in self.windows]
    h, _ = self._decoder(input_ids, positions, masks, dropout_rng=dropout_rng, embeddings_hook=embeddings_hook)
    return h

  def init_cache(self, batch_size: int, num_slots: int) -> KVCache:
    """An empty (zero) cache of `num_slots` slots for every layer, in the activation dtype."""
    cfg = self.config
    shape = (cfg.num_layers, batch_size, num_slots, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, self.activation_dtype), jnp.zeros(shape, self.activation_dtype))

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
    """Input embeddings (B, T, H) in the activation dtype; Gemma scales them by √hidden."""
    h = table_rows(self.embed_tokens, jnp.asarray(input_ids), self.dtype).astype(self.activation_dtype)
    if self.config.scale_embeddings:  # the scale rounded to the weights' dtype, as HF's
      h = h * jnp.asarray(self.config.hidden_size ** 0.5, jnp.float32).astype(self.dtype).astype(h.dtype)
    return h

  def _decoder(self, input_ids, positions, masks, *, dropout_rng=None, cache: KVCache | None = None,
               cache_start=0, embeddings_hook=None) -> tuple[jax.Array, KVCache | None]:
    """Embed, run the scanned layer stack, final norm: (hidden states, updated cache or None).

    `masks` holds one mask per distinct window (`self.windows`); with several, each layer picks
    its own by a scanned index, and so with RoPE tables (`self.rope_kinds`)."""
    positions = jnp.asarray(positions)
    tables = [rope_tables(positions, rope_inv_freq(self.config, kind), self.activation_dtype,
                          rotary_dim=self.config.rotary_dim)
              for kind in self.rope_kinds]
    h = self.embed(input_ids)
    if embeddings_hook is not None:
      h = embeddings_hook(h)

    graphdef, layer_state = nnx.split(self.layers)
    if jax.default_backend() == "cpu":  # 16-bit weights sliced as float32 bits (`stack16`)
      layer_state, layer_dtypes = stack16.pack_tree(layer_state)
    else:
      layer_dtypes = None
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
      if layer_dtypes is not None:
        state = stack16.unpack_tree(state, layer_dtypes)
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
    """Logits (B, T, V) in the activation dtype (the loss upcasts to float32)."""
    h = self.hidden_states(input_ids, attention_mask, positions, segment_ids, dropout_rng=dropout_rng)
    return matmul_t(h, self.output_embedding())


Llama = CausalLM


def init_random(config: LlamaConfig, *, dtype="float32", seed: int = 0, **kwargs) -> CausalLM:
  """A randomly initialized model (tests, benchmarks)."""
  return CausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed), **kwargs)
