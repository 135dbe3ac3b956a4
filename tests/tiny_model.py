"""A tiny random Llama saved as a Hugging Face directory (config.json, safetensors, tokenizer).

It uses the real SmolLM2 tokenizer (vocab 49,152) so the data path is the real one; only the
transformer is tiny. Written with jaxsft's own exporter: no torch needed.
"""

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from jaxsft import models

TINY = models.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=100000.0, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)


def make_tiny_model_dir(path, tokenizer, *, seed: int = 0, nan_weights: bool = False) -> pathlib.Path:
  """`nan_weights`: layer 0's q_proj is all NaN (a corrupt checkpoint: every loss is NaN)."""
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  model = models.init_random(TINY, seed=seed)
  tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in models.to_hf_state_dict(model).items()}
  if nan_weights:
    tensors["model.layers.0.self_attn.q_proj.weight"][:] = np.nan
  save_file(tensors, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(models.to_hf_config(TINY), indent=2))
  tokenizer.save_pretrained(str(path))
  return path
