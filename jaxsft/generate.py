"""Greedy generation with a key/value cache, for the tuned-vs-base evaluation.

Prompts are rendered with the chat template (generation prompt added), left-padded to a bucket
length P and run once (prefill) to fill a per-layer cache of S = P + max_new_tokens slots; each
new token then costs one position, not a pass over the whole sequence. The whole decode is one
jitted `while_loop` that ends when every row has produced an end-of-turn token, so one shape
(rows, P) is one compile. The layer math is the model's own modules (projections, RoPE, norms,
attention kernel); only the cache bookkeeping lives here.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsft.models import llama


def _cached_layer(layer: llama.DecoderLayer, h, cos, sin, k_cache, v_cache, start, key_mask):
  """One decoder layer over new tokens h (B, t, H) at cache slots [start, start + t)."""
  attn = layer.self_attn
  x = layer.input_layernorm(h)
  b, t, _ = x.shape
  q = attn.q_proj(x).reshape(b, t, attn.num_heads, attn.head_dim)
  k = attn.k_proj(x).reshape(b, t, attn.num_kv_heads, attn.head_dim)
  v = attn.v_proj(x).reshape(b, t, attn.num_kv_heads, attn.head_dim)
  q, k = llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin)
  k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
  v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
  slots = jnp.arange(k_cache.shape[1])
  causal = slots[None, :] <= (start + jnp.arange(t))[:, None]  # (t, S)
  mask = causal[None, None] & (key_mask[:, None, None, :] != 0)  # (B, 1, t, S)
  out = llama.ATTENTION[attn.attention](q, k_cache, v_cache, mask, attn.head_dim ** -0.5)
  h = h + attn.o_proj(out.reshape(b, t, -1))
  return h + layer.mlp(layer.post_attention_layernorm(h)), k_cache, v_cache


def _forward(model: llama.CausalLM, tokens, positions, caches, start, key_mask):
  """Logits of the last new token (B, V) and the updated caches."""
  cos, sin = llama.rope_tables(positions, llama.rope_inv_freq(model.config), model.dtype)
  h = jnp.take(model.embed_tokens[...], tokens, axis=0)
  graphdef, layer_state = nnx.split(model.layers)

  def step(h, xs):
    state, k_cache, v_cache = xs
    h, k_cache, v_cache = _cached_layer(nnx.merge(graphdef, state), h, cos, sin, k_cache, v_cache, start, key_mask)
    return h, (k_cache, v_cache)

  h, caches = jax.lax.scan(step, h, (layer_state, *caches))
  h = model.norm(h[:, -1])
  return (h @ model.output_embedding().T).astype(jnp.float32), caches


@functools.partial(jax.jit, static_argnums=(0, 5))
def _greedy(graphdef, state, prompt_ids, prompt_mask, stop_ids, max_new_tokens: int):
  model = nnx.merge(graphdef, state)
  cfg = model.config
  b, p = prompt_ids.shape
  s = p + max_new_tokens
  cache_shape = (cfg.num_layers, b, s, cfg.num_kv_heads, cfg.head_dim)
  caches = (jnp.zeros(cache_shape, model.dtype), jnp.zeros(cache_shape, model.dtype))
  key_mask = jnp.concatenate([prompt_mask, jnp.ones((b, max_new_tokens), prompt_mask.dtype)], axis=1)
  positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
  logits, caches = _forward(model, prompt_ids, positions, caches, 0, key_mask)
  next_pos = positions[:, -1:] + 1
  out = jnp.zeros((b, max_new_tokens), jnp.int32)

  def cond(carry):
    i, _, _, _, done, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, logits, caches, out, done, pos = carry
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    token = jnp.where(done, stop_ids[0], token)
    out = out.at[:, i].set(token)
    done = done | jnp.isin(token, stop_ids)
    logits, caches = _forward(model, token[:, None], pos, caches, p + i, key_mask)
    return i + 1, logits, caches, out, done, pos + 1

  carry = (jnp.int32(0), logits, caches, out, jnp.zeros((b,), bool), next_pos)
  _, _, _, out, _, _ = jax.lax.while_loop(cond, body, carry)
  return out


def stop_token_ids(tokenizer, model) -> list[int]:
  ids = {tokenizer.eos_token_id}
  eos = model.config.eos_token_id
  ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
  return sorted(i for i in ids if i is not None)


def generate(model, tokenizer, prompts: Sequence[Sequence[dict]], *, max_new_tokens: int = 32,
             batch_size: int = 8, prompt_multiple: int = 128) -> list[str]:
  """Greedy replies (text, special tokens removed) to chat prompts (lists of messages).

  Prompts are sorted by length and decoded `batch_size` at a time, each chunk left-padded to a
  multiple of `prompt_multiple`: one long prompt costs its own chunk, not every row's padding.
  """
  from jaxsft.data.tokenize import _render  # the same template path the training data uses

  graphdef, state = nnx.split(model)
  stop_list = stop_token_ids(tokenizer, model)
  stops = jnp.asarray(stop_list, jnp.int32)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_list[0]
  encoded = [tokenizer(_render(tokenizer, list(m), generation_prompt=True), add_special_tokens=False)["input_ids"]
             for m in prompts]
  order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
  replies: list[str] = [""] * len(encoded)
  for start in range(0, len(order), batch_size):
    chunk = order[start:start + batch_size]
    p = -(-max(len(encoded[i]) for i in chunk) // prompt_multiple) * prompt_multiple
    ids = np.full((batch_size, p), pad, np.int32)
    mask = np.zeros((batch_size, p), np.int32)
    for row, i in enumerate(chunk):
      e = encoded[i]
      ids[row, p - len(e):], mask[row, p - len(e):] = e, 1
    mask[len(chunk):, -1] = 1  # filler rows: one visible token, so no row attends to nothing
    out = np.asarray(_greedy(graphdef, state, ids, mask, stops, max_new_tokens))
    for row, i in enumerate(chunk):
      tokens = out[row].tolist()
      stop_at = next((j for j, t in enumerate(tokens) if t in stop_list), len(tokens))
      replies[i] = tokenizer.decode(tokens[:stop_at], skip_special_tokens=True)
  return replies
