"""The runtime needs no torch: the real model and its tokenizer load from the GGUF, with every
cache empty, and then from the cache that load wrote, in an interpreter where torch cannot be
found (transformers' own GGUF reader imports torch, so this path must not go through it)."""

import os
import subprocess
import sys
import textwrap

import pytest

from hide_torch import PRELUDE
from test_train import ROOT

SCRIPT = PRELUDE + textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jaxsft import models
    model, tok = models.load_model("smollm2-135m-instruct")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    logits = jax.jit(lambda m, x: m(x))(model, jnp.asarray([ids], jnp.int32))
    assert tok.pad_token_id == tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert bool(jnp.isfinite(logits).all()) and logits.shape[-1] == 49152
    # Loaded again, now from the dequantized safetensors cache the first load wrote; the training
    # modules import without torch too.
    from jaxsft import lora, loss
    again = models.load_causal_lm("smollm2-135m-instruct")
    assert (again.config.num_layers, again.config.tie_word_embeddings) == (30, True)
    assert "torch" not in sys.modules
    print("OK", len(ids))
""")


@pytest.mark.slow
def test_real_model_and_tokenizer_load_without_torch_from_an_empty_cache(tmp_path):
  env = dict(os.environ, HF_HUB_OFFLINE="1", JAXSFT_CACHE=str(tmp_path / "cache"))
  r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.startswith("OK")
  assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").rglob("tokenizer_config.json"))
