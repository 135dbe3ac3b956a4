"""KV-cache greedy generation equals greedy decoding by full forward passes (left padding too)."""

import dataclasses

import jax.numpy as jnp

from jaxsft import models
from jaxsft.data.tokenize import _render
from jaxsft.generate import generate, stop_token_ids
from tiny_model import TINY


def naive_greedy(model, tokenizer, messages, max_new_tokens):
  ids = tokenizer(_render(tokenizer, messages, generation_prompt=True), add_special_tokens=False)["input_ids"]
  out = []
  for _ in range(max_new_tokens):
    token = int(jnp.argmax(model(jnp.asarray([ids + out], jnp.int32))[0, -1]))
    if token in stop_token_ids(tokenizer, model):
      break
    out.append(token)
  return tokenizer.decode(out, skip_special_tokens=True)


def test_cached_generation_matches_full_recompute(tokenizer):
  # Untied head: a random tied model just repeats its last input token, which hides bugs.
  model = models.init_random(dataclasses.replace(TINY, tie_word_embeddings=False), seed=3)
  prompts = [[{"role": "user", "content": "What is 2+2?"}],
             [{"role": "user", "content": "Reverse the word 'banana', and here are more words to make it longer."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
  got = generate(model, tokenizer, prompts, max_new_tokens=6)
  want = [naive_greedy(model, tokenizer, p, 6) for p in prompts]
  assert got == want
  assert len(set(got)) == 3 and all(got)


def test_cached_generation_honours_the_sliding_window(tokenizer):
  # Prompts (chat template included) are several windows long: a cache that ignored the
  # window would attend to keys the full forward cannot see and pick other tokens.
  config = dataclasses.replace(TINY, model_type="mistral", sliding_window=8, tie_word_embeddings=False)
  model = models.init_random(config, seed=3)
  # The topic comes last: with 2 layers of window 8 only the last ~14 prompt tokens matter.
  prompts = [[{"role": "user", "content": f"In two or three sentences, please tell me about {topic}"}]
             for topic in ("rivers", "the moon and its phases", "prime numbers")]
  want = [naive_greedy(model, tokenizer, p, 8) for p in prompts]
  assert generate(model, tokenizer, prompts, max_new_tokens=8) == want
  assert len(set(want)) == 3
