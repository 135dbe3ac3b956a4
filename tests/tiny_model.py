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


# Tiny `config.json`s of the other families (vocab 49,152 for the real tokenizer; every layer kind
# of a family present: sliding and full layers, NoPE layers, fused projections).
FAMILY_CONFIGS = {
    "qwen3": {"model_type": "qwen3", "head_dim": 32, "use_sliding_window": True, "sliding_window": 24,
              "max_window_layers": 2},
    "gemma3_text": {"model_type": "gemma3_text", "query_pre_attn_scalar": 24, "sliding_window": 24,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "smollm3": {"model_type": "smollm3", "no_rope_layers": [1, 0, 1, 0], "tie_word_embeddings": True},
    "phi3": {"model_type": "phi3", "sliding_window": 48,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    "olmo2": {"model_type": "olmo2"},
}


def family_config(kind: str) -> models.LlamaConfig:
  base = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
  return models.from_hf_config({**base, **FAMILY_CONFIGS[kind]})


def make_family_model_dir(path, tokenizer, kind: str, *, seed: int = 0) -> pathlib.Path:
  """A tiny random model of family `kind` as a Hugging Face folder (with non-trivial norms)."""
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  config = family_config(kind)
  rng = np.random.default_rng(seed)
  tensors = {}
  for name, value in models.to_hf_state_dict(models.init_random(config, seed=seed)).items():
    value = np.array(value, np.float32)
    if value.ndim == 1:  # norms: random scales, so that a norm applied in the wrong place shows
      value = rng.uniform(0.5, 1.5, value.shape).astype(np.float32)
    tensors[name] = value
  save_file(tensors, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(models.to_hf_config(config), indent=2))
  tokenizer.save_pretrained(str(path))
  return path
