"""Greedy generation with a key/value cache, for the tuned-vs-base evaluation.

Prompts are rendered with the chat template (generation prompt added), left-padded to a bucket
length P and run once (prefill) to fill a per-layer cache of S = P + max_new_tokens slots; each
new token then costs one position, not a pass over the whole sequence. The whole decode is one
jitted `while_loop` that ends when every row has produced an end-of-turn token, so one shape
(rows, P) is one compile. The forward pass is the model's own (`CausalLM.cached_hidden_states`,
the same decoder layers as training); only the greedy loop and the slot layout live here.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsft.models import llama


def _last_token_logits(model: llama.CausalLM, tokens, positions, cache, start, key_mask):
  """Float32 logits (B, V) of the last of the new tokens, and the updated cache."""
  h, cache = model.cached_hidden_states(tokens, positions, cache, start, key_mask)
  return (h[:, -1] @ model.output_embedding().T).astype(jnp.float32), cache


@functools.partial(jax.jit, static_argnums=(0, 5))
def _greedy(graphdef, state, prompt_ids, prompt_mask, stop_ids, max_new_tokens: int):
  model = nnx.merge(graphdef, state)
  b, p = prompt_ids.shape
  cache = model.init_cache(b, p + max_new_tokens)
  # Slot layout: the left-padded prompt in slots [0, P), new token i in slot P + i. A row's real
  # tokens are contiguous (pads only on its left), so the slot distance between two real tokens
  # equals their position distance, and the model's sliding window, counted in slots, is the
  # window on positions that training applies.
  key_mask = jnp.concatenate([prompt_mask, jnp.ones((b, max_new_tokens), prompt_mask.dtype)], axis=1)
  positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
  logits, cache = _last_token_logits(model, prompt_ids, positions, cache, 0, key_mask)
  next_pos = positions[:, -1:] + 1
  out = jnp.zeros((b, max_new_tokens), jnp.int32)

  def cond(carry):
    i, _, _, _, done, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, logits, cache, out, done, pos = carry
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    token = jnp.where(done, stop_ids[0], token)
    out = out.at[:, i].set(token)
    done = done | jnp.isin(token, stop_ids)
    logits, cache = _last_token_logits(model, token[:, None], pos, cache, p + i, key_mask)
    return i + 1, logits, cache, out, done, pos + 1

  carry = (jnp.int32(0), logits, cache, out, jnp.zeros((b,), bool), next_pos)
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
