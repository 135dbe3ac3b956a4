"""GGUF exports of the new families, read back by transformers' own GGUF loader
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`), give the jaxsft model's logits.

transformers reads Qwen3, Gemma 3 and Phi-3 GGUF files (SmolLM3 and OLMo 2 it does not: see the
last test). Each model is the conftest's tiny family model, changed only where a setting has no
GGUF key, or one transformers' GGUF reader ignores and so fills in from its config defaults:

- Qwen3: no sliding layers (llama.cpp's qwen3 has none); head_dim 128, because transformers
  keeps Qwen3Config's default head_dim instead of reading attention.key_length.
- Gemma 3: six layers in llama.cpp's fixed pattern (five sliding, one full) with unscaled RoPE;
  head_dim = query_pre_attn_scalar = 256, because transformers keeps Gemma3TextConfig's default
  query_pre_attn_scalar (256) and reads no rope scaling.
- Phi-3: full rotary and no window: transformers drops rope.dimension_count and
  attention.sliding_window for phi3 (jaxsft writes and reads both, see tests/test_export.py).

The weights come from a saved transformers folder, which jaxsft loads and exports with the
SmolLM2 tokenizer. Checked on a prompt longer than Gemma's window, in float32: transformers from
the GGUF against transformers from the folder (the same torch code: only llama.cpp's layout and
metadata conventions can differ) and against jaxsft (≤ 1e-4).
"""

import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_hf_config

from jaxsft import export, models
from jaxsft.models.gguf import gguf_refusal
from jaxsft.models.gguf.llama_cpp import gemma3_sliding_layers

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 3 here has head_dim 256 (see above) and sqrt(hidden)-scaled embeddings: float32 rounding
# between torch's and XLA's CPU kernels reaches ~1e-4 on its logits (|logits| up to ~8), and how
# far depends on the CPU's vector width. The other families keep 1e-4.
LOGIT_NOISE_FLOOR = {"gemma3_text": 2e-4}


def gguf_hf_config(kind):
  config = tiny_hf_config(kind)
  if kind == "qwen3":
    config.head_dim = 128
    config.use_sliding_window, config.sliding_window = False, None
    config.layer_types = [FULL] * config.num_hidden_layers
  elif kind == "gemma3_text":
    config.num_hidden_layers = 6
    config.layer_types = [SLIDING if s else FULL for s in gemma3_sliding_layers(6)]
    config.head_dim = config.query_pre_attn_scalar = 256
    config.rope_parameters = {FULL: {"rope_type": "default", "rope_theta": 1e6},
                              SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
  elif kind == "phi3":
    config.sliding_window = None
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}
  return config


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "gemma3_text", "phi3"])
def test_gguf_export_loads_in_transformers_to_the_jaxsft_logits(kind, tokenizer, tmp_path):
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(gguf_hf_config(kind), dtype=torch.float32)
  with torch.no_grad():  # non-trivial norm weights, so that Gemma's 1 + w convention shows
    for name, p in hf.named_parameters():
      if p.ndim == 1:
        p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
  hf.save_pretrained(tmp_path / "hf")
  tokenizer.save_pretrained(tmp_path / "hf")
  jax_model = models.load_causal_lm(str(tmp_path / "hf"), dtype="float32")
  assert gguf_refusal(jax_model.config) is None

  out = export.export(str(tmp_path / "hf"), None, tmp_path / "gguf", fmt="gguf", dtype="float32")
  from_gguf = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf",
                                                                dtype=torch.float32).eval()
  assert type(from_gguf) is type(hf)
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": "Name three rivers of Europe and say which sea each one flows into."}],
      tokenize=False, add_generation_prompt=True)
  ids = np.asarray([tokenizer(text, add_special_tokens=False)["input_ids"]])
  assert ids.shape[1] > 24  # past Gemma's window
  with torch.no_grad():
    got = from_gguf(torch.as_tensor(ids)).logits.numpy()
    folder = hf.eval()(torch.as_tensor(ids)).logits.numpy()
  want = np.asarray(jax_model(ids))
  same_code, vs_jaxsft = np.abs(got - folder).max(), np.abs(got - want).max()
  print(f"{kind}: transformers from GGUF vs from the folder {same_code:.1e}, vs jaxsft {vs_jaxsft:.1e}")
  assert same_code <= 1e-6
  assert vs_jaxsft <= LOGIT_NOISE_FLOOR.get(kind, 1e-4)


def test_transformers_has_no_gguf_reader_for_smollm3_and_olmo2():
  """Why the file above has no SmolLM3/OLMo 2 case (their GGUF round trip through jaxsft is in
  tests/test_export.py); if transformers gains a reader, a case belongs above."""
  from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

  assert {"qwen3", "gemma3", "phi3"} <= set(GGUF_SUPPORTED_ARCHITECTURES)
  assert not {"smollm3", "olmo2"} & set(GGUF_SUPPORTED_ARCHITECTURES)
