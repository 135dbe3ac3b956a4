"""KV-cache greedy generation equals greedy decoding by full forward passes (left padding too)."""

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxsft import models
from jaxsft.data.template import render_chat
from jaxsft.generate import generate, stop_token_ids
from tiny_model import TINY


# One compiled forward per length (an eager forward would compile each of its ops per length).
_full_forward = nnx.jit(lambda model, ids: model(ids))


def naive_greedy(model, tokenizer, messages, max_new_tokens):
  ids = tokenizer(render_chat(tokenizer, messages, generation_prompt=True), add_special_tokens=False)["input_ids"]
  out = []
  for _ in range(max_new_tokens):
    token = int(jnp.argmax(_full_forward(model, jnp.asarray([ids + out], jnp.int32))[0, -1]))
    if token in stop_token_ids(tokenizer, model):
      break
    out.append(token)
  return tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------------------
# Sampling and streaming.

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxsft.generate import (PromptTooLong, Sampling, mask_top_k, mask_top_p, sample_token,  # noqa: E402
                             scale_by_temperature, stream)


def test_top_k_and_top_p_masks():
  logits = jnp.log(jnp.asarray([[0.5, 0.05, 0.3, 0.15], [0.1, 0.2, 0.3, 0.4]]))
  kept = lambda x: np.isfinite(np.asarray(x))
  assert kept(mask_top_k(logits, 2)).tolist() == [[True, False, True, False], [False, False, True, True]]
  assert kept(mask_top_k(logits, 0)).all() and kept(mask_top_p(logits, 1.0)).all()
  # p = 0.75: row 0 keeps 0.5 and 0.3 (0.5 < 0.75, 0.8 >= 0.75 stops after it); row 1 keeps 0.4, 0.3, 0.2
  assert kept(mask_top_p(logits, 0.75)).tolist() == [[True, False, True, False], [False, True, True, True]]
  assert kept(mask_top_p(logits, 1e-6)).sum(-1).tolist() == [1, 1]  # the most likely token always stays
  np.testing.assert_allclose(scale_by_temperature(logits, 2.0), logits / 2)


def test_sample_token_is_greedy_at_zero_and_follows_the_distribution():
  logits = jnp.log(jnp.asarray([0.6, 0.3, 0.1, 1e-9]))
  assert int(sample_token(logits, jax.random.key(0), Sampling())) == 0
  keys = jax.random.split(jax.random.key(0), 4000)
  draws = np.asarray(jax.vmap(lambda k: sample_token(logits, k, Sampling(temperature=1.0)))(keys))
  np.testing.assert_allclose(np.bincount(draws, minlength=4) / len(draws), [0.6, 0.3, 0.1, 0], atol=0.03)
  top1 = np.asarray(jax.vmap(lambda k: sample_token(logits, k, Sampling(temperature=1.0, top_k=1)))(keys))
  assert (top1 == 0).all()
  nucleus = np.asarray(jax.vmap(lambda k: sample_token(logits, k, Sampling(temperature=1.0, top_p=0.8)))(keys))
  assert set(np.unique(nucleus)) == {0, 1}
  with pytest.raises(ValueError, match="top_p"):
    Sampling(top_p=0.0)


@pytest.mark.slow
def test_stream_yields_the_greedy_reply_piece_by_piece(tokenizer):
  model = models.init_random(dataclasses.replace(TINY, tie_word_embeddings=False), seed=3)
  messages = [{"role": "user", "content": "Reverse the word 'banana', please."}]
  pieces = list(stream(model, tokenizer, messages, max_new_tokens=6))
  assert len(pieces) >= 2 and "".join(pieces) == generate(model, tokenizer, [messages], max_new_tokens=6)[0]
  sampled = [generate(model, tokenizer, [messages], max_new_tokens=6, sampling=Sampling(temperature=2.0), seed=s)[0]
             for s in (0, 0, 1)]
  assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def test_a_prompt_longer_than_the_window_is_a_clear_error(tokenizer):
  model = models.init_random(dataclasses.replace(TINY, max_position_embeddings=64), seed=0)
  long = [{"role": "user", "content": "word " * 100}]
  with pytest.raises(PromptTooLong, match=r"prompt 1 is \d+ tokens .* context window is 64 tokens"):
    generate(model, tokenizer, [[{"role": "user", "content": "hi"}], long], max_new_tokens=4)
  with pytest.raises(PromptTooLong, match="context window is 64 tokens"):
    list(stream(model, tokenizer, long))
