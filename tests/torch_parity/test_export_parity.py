"""Exported models load in transformers without jaxsft and give peft's logits (base + adapter).

The adapter is a random all-linear LoRA made by jaxsft; `python -m jaxsft.export`'s function
merges it and writes an HF folder and a GGUF file. transformers loads the folder
(`AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(out)`) and the GGUF (its own GGUF
reader, which undoes llama.cpp's q/k permutation itself); both must match peft's logits for the
same base and adapter within 1e-3.
"""

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxsft import export, lora
from parity_utils import peft_copy, randomize_lora_b

CASES = [pytest.param("smollm2", marks=pytest.mark.slow), "tiny_qwen2"]


def _base_name(which, torch_model, tokenizer, tmp_path) -> str:
  if which == "smollm2":
    return "smollm2-135m-instruct"
  folder = tmp_path / "base"  # the fixture's weights, saved with a tokenizer so the export has one
  torch_model.save_pretrained(folder)
  tokenizer.save_pretrained(folder)
  return str(folder)


def _logits(model, ids):
  with torch.no_grad():
    return model(torch.as_tensor(ids)).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("which", CASES)
def test_exported_hf_folder_and_gguf_match_peft(which, request, tokenizer, tmp_path):
  torch_model, jax_model = request.getfixturevalue(which)
  base = _base_name(which, torch_model, tokenizer, tmp_path)
  tuned = randomize_lora_b(lora.apply_lora(nnx.clone(jax_model), r=8, alpha=16, target_modules="all-linear",
                                           seed=1), scale=0.02)
  lora.save_adapter(tuned, tmp_path / "adapter", base_model_name_or_path=base)
  text = tokenizer.apply_chat_template([{"role": "user", "content": "Which word comes after 'river'? stone, river, cloud"}],
                                       tokenize=False, add_generation_prompt=True)
  ids = np.asarray([tokenizer(text, add_special_tokens=False)["input_ids"]])
  want = _logits(peft_copy(torch_model, adapter=tmp_path / "adapter"), ids)
  assert np.abs(want - _logits(torch_model, ids)).max() > 1e-2  # the adapter changes the logits

  hf_dir = export.export(base, str(tmp_path / "adapter"), tmp_path / "hf")
  exported = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  err = np.abs(_logits(exported, ids) - want).max()
  print(f"{which}: HF export vs peft max |Δlogit| {err:.1e}")
  assert err <= 1e-3
  reloaded_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  assert reloaded_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                add_generation_prompt=True) == \
      tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)

  gguf_dir = export.export(base, str(tmp_path / "adapter"), tmp_path / "gguf", fmt="gguf", dtype="float32")
  from_gguf = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="model.gguf",
                                                                dtype=torch.float32).eval()
  err = np.abs(_logits(from_gguf, ids) - want).max()
  print(f"{which}: GGUF export (transformers' GGUF loader) vs peft max |Δlogit| {err:.1e}")
  assert err <= 1e-3
