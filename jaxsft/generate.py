"""Generation with a key/value cache: batched (evaluation, batch chat) and streamed (chat).

Prompts are rendered with the chat template (generation prompt added), left-padded to a bucket
length P and run once (prefill) to fill a per-layer cache of S = P + max_new_tokens slots; each
new token then costs one position, not a pass over the whole sequence. The forward pass is the
model's own (`CausalLM.cached_hidden_states`, the same decoder layers as training); only the
token choice and the slot layout live here.

- `generate`: the whole decode of a batch is one jitted `while_loop` that ends when every row
  has produced an end-of-turn token, so one shape (rows, P) is one compile.
- `stream`: one conversation, token by token (a jitted prefill, then a jitted one-token step
  called from Python), so a caller can print each piece as it is produced.

Token choice is `sample_token` (greedy at temperature 0, else temperature → top-k → top-p →
a categorical draw), built from the small pure functions below.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsft.errors import JaxsftError
from jaxsft.models.decoder import CausalLM, with_layers_packed


class PromptTooLong(JaxsftError, ValueError):
  """The rendered prompt does not fit in the model's context window."""


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen. temperature 0: greedy (argmax); top_k 0 / top_p 1: off."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


GREEDY = Sampling()


# ---------------------------------------------------------------------------------------------
# Token choice: pure functions of float32 logits (..., V).


def scale_by_temperature(logits: jax.Array, temperature: float) -> jax.Array:
  """logits / T (T > 0): T < 1 sharpens the distribution, T > 1 flattens it."""
  return logits / temperature


def mask_top_k(logits: jax.Array, k: int) -> jax.Array:
  """Keeps the k largest logits per row (ties at the k-th value kept too), others -> -inf."""
  if k <= 0 or k >= logits.shape[-1]:
    return logits
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits < kth, -jnp.inf, logits)


def mask_top_p(logits: jax.Array, p: float) -> jax.Array:
  """Nucleus: keeps the smallest set of most likely tokens whose probability sum reaches p.

  With tokens sorted by probability π_(1) ≥ π_(2) ≥ ..., token (j) is kept iff
  Σ_{i<j} π_(i) < p, so the most likely token is always kept.
  """
  if p >= 1.0:
    return logits
  order = jnp.argsort(-logits, axis=-1)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = before < p
  keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order
  return jnp.where(keep, logits, -jnp.inf)


def sample_token(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """Next token ids (...,) int32: argmax at temperature 0, else a draw from the masked softmax."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = scale_by_temperature(logits.astype(jnp.float32), sampling.temperature)
  logits = mask_top_p(mask_top_k(logits, sampling.top_k), sampling.top_p)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# The cached forward pass.


def _last_token_logits(model: CausalLM, tokens, positions, cache, start, key_mask):
  """Float32 logits (B, V) of the last of the new tokens, and the updated cache."""
  h, cache = model.cached_hidden_states(tokens, positions, cache, start, key_mask)
  return (h[:, -1] @ model.output_embedding().T).astype(jnp.float32), cache


def _prefill(model, prompt_ids, prompt_mask, max_new_tokens: int):
  """Slot layout: the left-padded prompt in slots [0, P), new token i in slot P + i.

  A row's real tokens are contiguous (pads only on its left), so the slot distance between two
  real tokens equals their position distance, and the model's sliding window, counted in slots,
  is the window on positions that training applies.
  """
  b, p = prompt_ids.shape
  cache = model.init_cache(b, p + max_new_tokens)
  key_mask = jnp.concatenate([prompt_mask, jnp.ones((b, max_new_tokens), prompt_mask.dtype)], axis=1)
  positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
  logits, cache = _last_token_logits(model, prompt_ids, positions, cache, 0, key_mask)
  return logits, cache, key_mask, positions[:, -1:] + 1


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _decode(graphdef, state, prompt_ids, prompt_mask, stop_ids, max_new_tokens: int, sampling: Sampling, key):
  model = nnx.merge(graphdef, state)
  b, p = prompt_ids.shape
  logits, cache, key_mask, next_pos = _prefill(model, prompt_ids, prompt_mask, max_new_tokens)
  out = jnp.zeros((b, max_new_tokens), jnp.int32)

  def cond(carry):
    i, _, _, _, done, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, logits, cache, out, done, pos = carry
    token = sample_token(logits, jax.random.fold_in(key, i), sampling)
    token = jnp.where(done, stop_ids[0], token)
    out = out.at[:, i].set(token)
    done = done | jnp.isin(token, stop_ids)
    logits, cache = _last_token_logits(model, token[:, None], pos, cache, p + i, key_mask)
    return i + 1, logits, cache, out, done, pos + 1

  carry = (jnp.int32(0), logits, cache, out, jnp.zeros((b,), bool), next_pos)
  _, _, _, out, _, _ = jax.lax.while_loop(cond, body, carry)
  return out


def stop_token_ids(tokenizer, model) -> list[int]:
  """The model's end-of-turn ids: the tokenizer's eos and the config's eos id(s)."""
  ids = {tokenizer.eos_token_id}
  eos = model.config.eos_token_id
  ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
  return sorted(i for i in ids if i is not None)


def context_window(model) -> int:
  return int(model.config.max_position_embeddings)


def encode_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
  """Token ids of a conversation rendered with the chat template, generation prompt added."""
  from jaxsft.data.template import render_chat  # the same template path the training data uses

  return tokenizer(render_chat(tokenizer, list(messages), generation_prompt=True), add_special_tokens=False)["input_ids"]


def check_prompt_fits(n_prompt: int, model, where: str = "prompt") -> None:
  window = context_window(model)
  if n_prompt >= window:
    raise PromptTooLong(f"{where} is {n_prompt} tokens with the chat template; the model's context window is "
                        f"{window} tokens, which leaves no room for a reply. Shorten it (or /reset the conversation).")


def _room(n_prompt: int, model, max_new_tokens: int) -> int:
  """New tokens that still fit in the window after a prompt of n_prompt tokens."""
  return max(1, min(max_new_tokens, context_window(model) - n_prompt))


def generate(model, tokenizer, prompts: Sequence[Sequence[dict]], *, max_new_tokens: int = 32,
             batch_size: int = 8, prompt_multiple: int = 128, sampling: Sampling = GREEDY,
             seed: int = 0) -> list[str]:
  """Replies (text, special tokens removed) to chat prompts (lists of messages); greedy by default.

  Prompts are sorted by length and decoded `batch_size` at a time, each chunk left-padded to a
  multiple of `prompt_multiple`: one long prompt costs its own chunk, not every row's padding.
  A prompt that does not fit in the model's window raises `PromptTooLong` naming its index.
  """
  graphdef, state = nnx.split(model)
  state = with_layers_packed(state)  # packed once, not in every call
  stop_list = stop_token_ids(tokenizer, model)
  stops = jnp.asarray(stop_list, jnp.int32)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_list[0]
  encoded = [encode_prompt(tokenizer, m) for m in prompts]
  for i, e in enumerate(encoded):
    check_prompt_fits(len(e), model, f"prompt {i}")
  order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
  replies: list[str] = [""] * len(encoded)
  key = jax.random.key(seed)
  for start in range(0, len(order), batch_size):
    chunk = order[start:start + batch_size]
    longest = max(len(encoded[i]) for i in chunk)
    p = -(-longest // prompt_multiple) * prompt_multiple
    new = _room(longest, model, max_new_tokens)
    ids = np.full((batch_size, p), pad, np.int32)
    mask = np.zeros((batch_size, p), np.int32)
    for row, i in enumerate(chunk):
      e = encoded[i]
      ids[row, p - len(e):], mask[row, p - len(e):] = e, 1
    mask[len(chunk):, -1] = 1  # filler rows: one visible token, so no row attends to nothing
    out = np.asarray(_decode(graphdef, state, ids, mask, stops, new, sampling, jax.random.fold_in(key, start)))
    for row, i in enumerate(chunk):
      tokens = out[row].tolist()
      stop_at = next((j for j, t in enumerate(tokens) if t in stop_list), len(tokens))
      replies[i] = tokenizer.decode(tokens[:stop_at], skip_special_tokens=True)
  return replies


# ---------------------------------------------------------------------------------------------
# Streaming one conversation.


@functools.partial(jax.jit, static_argnums=(0, 4))
def _stream_prefill(graphdef, state, prompt_ids, prompt_mask, max_new_tokens: int):
  logits, cache, key_mask, next_pos = _prefill(nnx.merge(graphdef, state), prompt_ids, prompt_mask, max_new_tokens)
  return logits, cache, key_mask, next_pos


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(3,))
def _stream_step(graphdef, state, logits, cache, key_mask, pos, slot, sampling: Sampling, key):
  token = sample_token(logits, key, sampling)
  logits, cache = _last_token_logits(nnx.merge(graphdef, state), token[:, None], pos, cache, slot, key_mask)
  return token, logits, cache


def stream(model, tokenizer, messages: Sequence[dict], *, max_new_tokens: int = 256,
           sampling: Sampling = GREEDY, seed: int = 0, prompt_multiple: int = 128) -> Iterator[str]:
  """Yields the reply to one conversation as text pieces, as they are generated.

  Stops at an end-of-turn token or after `max_new_tokens` (fewer when the window is nearly
  full). Each piece is the new text since the last one (decoded incrementally, so a character
  split over several tokens is yielded once it is whole).
  """
  graphdef, state = nnx.split(model)
  state = with_layers_packed(state)  # packed once, not in every call
  stop_list = stop_token_ids(tokenizer, model)
  encoded = encode_prompt(tokenizer, messages)
  check_prompt_fits(len(encoded), model)
  new = _room(len(encoded), model, max_new_tokens)
  p = -(-len(encoded) // prompt_multiple) * prompt_multiple
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_list[0]
  ids = np.full((1, p), pad, np.int32)
  mask = np.zeros((1, p), np.int32)
  ids[0, p - len(encoded):], mask[0, p - len(encoded):] = encoded, 1
  logits, cache, key_mask, pos = _stream_prefill(graphdef, state, ids, mask, new)
  key = jax.random.key(seed)
  tokens: list[int] = []
  shown = ""
  for i in range(new):
    token, logits, cache = _stream_step(graphdef, state, logits, cache, key_mask, pos + i, p + i, sampling,
                                        jax.random.fold_in(key, i))
    token = int(token[0])
    if token in stop_list:
      break
    tokens.append(token)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if not text.endswith("\ufffd") and len(text) > len(shown):  # wait for a whole character
      yield text[len(shown):]
      shown = text
  text = tokenizer.decode(tokens, skip_special_tokens=True)
  if len(text) > len(shown):
    yield text[len(shown):]
