"""DoRA against peft's `LoraConfig(use_dora=True)` on the same weights (float32, highest precision):
logits, loss and the gradients of A, B and the magnitude; adapters both ways; the merged export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxsft import export, lora, loss
from parity_utils import (batch_of, jax_logits, jax_sums, jax_sums_and_lora_grads, model_inputs, peft_copy,
                          peft_named_grads, randomize_lora_b, rel_err, set_peft_weights, torch_logits,
                          torch_lora_grads, torch_nll_sum64)

DORA = {"r": 4, "alpha": 8, "target_modules": ("q_proj", "v_proj", "down_proj"), "use_dora": True}
PARTS = ("lora_A", "lora_B", "lora_magnitude_vector")


def dora_model(jax_model, seed=0, **settings):
  """A DoRA model whose B and magnitude are off their initial values (B ≠ 0, m ≠ ‖W + s·A B‖), so
  every part of the math, and every gradient, shows in a comparison."""
  model = randomize_lora_b(lora.apply_lora(nnx.clone(jax_model), seed=seed, **{**DORA, **settings}))
  for i, name in enumerate(model.lora_settings.target_modules):
    proj = lora._projection(model, name)
    m = proj.lora_magnitude[...]
    proj.lora_magnitude.set_value(m * (1 + 0.2 * jax.random.normal(jax.random.key(100 + i), m.shape)))
  return model


def peft_dora(torch_model, model):
  peft_model = peft_copy(torch_model, dict(r=DORA["r"], lora_alpha=DORA["alpha"], use_dora=True,
                                           target_modules=list(DORA["target_modules"]), lora_dropout=0.0))
  set_peft_weights(peft_model, lora.adapter_tensors(model))  # identical A, B and m on both sides
  return peft_model


def parts_rel_err(actual: dict, expected: dict, part: str) -> float:
  """‖actual − expected‖ / ‖expected‖ over every tensor of one part (A, B or the magnitude)."""
  keys = sorted(k for k in expected if f".{part}" in k)
  assert keys
  diff = sum(float(np.sum((np.float64(actual[k]) - np.float64(expected[k])) ** 2)) for k in keys)
  norm = sum(float(np.sum(np.float64(expected[k]) ** 2)) for k in keys)
  assert norm > 0, part  # a zero gradient would make the comparison empty
  return float(np.sqrt(diff / norm))


@pytest.mark.slow
@pytest.mark.parametrize("which", [pytest.param("smollm2", marks=pytest.mark.slow), "tiny_llama", "tiny_qwen2"])
def test_dora_logits_loss_and_gradients_match_peft(which, request, examples):
  torch_model, jax_model = request.getfixturevalue(which)
  model = dora_model(jax_model)
  peft_model = peft_dora(torch_model, model)
  batch = batch_of(examples[:2])

  t_logits = torch_logits(peft_model, batch)
  nll, count = torch_nll_sum64(t_logits, batch["labels"])
  t_loss = nll / count
  peft_model.zero_grad()
  t_loss.backward()
  t_grads = torch_lora_grads(peft_model)
  j_logits = np.asarray(nnx.jit(jax_logits)(model, model_inputs(batch)))
  base_logits = np.asarray(nnx.jit(jax_logits)(jax_model, model_inputs(batch)))
  (j_nll, j_count), grads = jax_sums_and_lora_grads(model, model_inputs(batch), batch["labels"])
  j_loss = float(j_nll) / int(j_count)
  j_grads = peft_named_grads(model, loss.normalize_by_valid(grads, j_count))

  t_logits = t_logits.detach().numpy()
  logit_err = float(np.abs(j_logits - t_logits).max())
  errs = {part: parts_rel_err(j_grads, t_grads, part) for part in PARTS}
  print(f"{which}: max |Δlogit| {logit_err:.1e} |Δloss| {abs(j_loss - t_loss.item()):.1e} grad rel err {errs}")
  assert np.abs(base_logits - t_logits).max() > 100 * 5e-4  # DoRA moves the logits: the check can see it
  assert sorted(j_grads) == sorted(t_grads)
  assert logit_err <= 5e-4
  assert abs(j_loss - t_loss.item()) <= 1e-5
  for part, err in errs.items():
    assert err <= 1e-4, (part, err)


def test_initial_dora_is_the_base_model(tiny_llama, examples):
  """m = ‖W‖ and B = 0 at init: m / ‖W + s·A B‖ is 1 (to the rounding of two float32 norms
  summed in different orders), the logits the base's."""
  _, jax_model = tiny_llama
  model = lora.apply_lora(nnx.clone(jax_model), **DORA)
  inputs = model_inputs(batch_of(examples[:2]))
  tuned = np.asarray(nnx.jit(jax_logits)(model, inputs))
  base = np.asarray(nnx.jit(jax_logits)(jax_model, inputs))
  assert np.abs(tuned - base).max() <= 1e-5 * np.abs(base).max()


@pytest.mark.slow
def test_dora_adapters_load_both_ways_and_merge_like_peft(tiny_qwen2, examples, tmp_path):
  """On the tiny Qwen2 only: the files and the merge do not depend on the model's size, and the
  real SmolLM2's parity is the test above (the round trip on it passed too, measured 1.2e-6 on the
  loss, at 45-110 s of CI time)."""
  torch_model, jax_model = tiny_qwen2
  batch = batch_of(examples[2:4], buckets=(96, 128))

  # jaxsft -> PEFT files -> peft in torch
  model = dora_model(jax_model, seed=1)
  lora.save_adapter(model, tmp_path / "from_jax")
  peft_model = peft_copy(torch_model, adapter=tmp_path / "from_jax")
  assert peft_model.peft_config["default"].use_dora
  with torch.no_grad():
    nll, count = torch_nll_sum64(torch_logits(peft_model, batch), batch["labels"])
  j_nll, j_count = jax_sums(model, model_inputs(batch), batch["labels"])
  assert abs(float(j_nll) / int(j_count) - nll.item() / count) <= 1e-5

  # peft in torch (random A and B, magnitude trained away from its init) -> PEFT files -> jaxsft -> files again
  torch.manual_seed(3)
  made_by_peft = peft_copy(torch_model, dict(r=4, lora_alpha=32, init_lora_weights=False, use_dora=True,
                                             target_modules=["k_proj", "o_proj", "up_proj"]))
  with torch.no_grad():
    for name, p in made_by_peft.named_parameters():
      if "lora_magnitude_vector" in name:
        p.mul_(1 + 0.2 * torch.randn_like(p))
      if "lora_B" in name:  # B as large as A would take SmolLM2 to a near-uniform loss, no adapter a run makes
        p.mul_(0.1)
  made_by_peft.save_pretrained(tmp_path / "from_peft")
  with torch.no_grad():
    logits = torch_logits(made_by_peft, batch)
    nll, count = torch_nll_sum64(logits, batch["labels"])
    base_nll, _ = torch_nll_sum64(torch_logits(torch_model, batch), batch["labels"])
  assert abs(base_nll.item() - nll.item()) / count > 1e-3  # the adapter moves the loss far past the tolerance
  loaded = lora.load_adapter(nnx.clone(jax_model), tmp_path / "from_peft")
  assert loaded.lora_settings.use_dora and loaded.lora_settings.target_modules == ("k_proj", "o_proj", "up_proj")
  j_nll, j_count = jax_sums(loaded, model_inputs(batch), batch["labels"])
  print(f"peft->jaxsft |Δloss|={abs(float(j_nll) / int(j_count) - nll.item() / count):.1e}")
  assert abs(float(j_nll) / int(j_count) - nll.item() / count) <= 1e-5
  lora.save_adapter(loaded, tmp_path / "back")
  from safetensors.numpy import load_file

  theirs, ours = load_file(tmp_path / "from_peft" / "adapter_model.safetensors"), \
      load_file(tmp_path / "back" / "adapter_model.safetensors")
  assert sorted(ours) == sorted(theirs) and any(k.endswith("lora_magnitude_vector") for k in ours)
  for k in theirs:
    np.testing.assert_array_equal(ours[k], theirs[k])

  # Merged: jaxsft's kernels are peft's merge_and_unload weights, and the merged model keeps the logits.
  merged = lora.merge_lora(nnx.clone(loaded))
  peft_merged = made_by_peft.merge_and_unload().state_dict()
  from jaxsft.models import hf_weights

  for name, value in hf_weights.to_hf_state_dict(merged).items():
    if any(m in name for m in ("k_proj", "o_proj", "up_proj")):
      assert rel_err(np.asarray(value), peft_merged[name].numpy()) <= 1e-5, name
  m_logits = np.asarray(nnx.jit(jax_logits)(merged, model_inputs(batch)))
  assert np.abs(m_logits - logits.numpy()).max() <= 5e-4


@pytest.mark.slow
def test_exported_dora_model_gives_peft_logits(tiny_qwen2, tokenizer, tmp_path):
  """`jaxsft.export` merges a DoRA adapter into an HF folder and a GGUF file that transformers
  loads to peft's logits (as test_export_parity does for LoRA)."""
  torch_model, jax_model = tiny_qwen2
  folder = tmp_path / "base"
  torch_model.save_pretrained(folder)
  tokenizer.save_pretrained(folder)
  tuned = dora_model(jax_model, seed=2, target_modules="all-linear")
  lora.save_adapter(tuned, tmp_path / "adapter", base_model_name_or_path=str(folder))
  ids = np.asarray([tokenizer("Which word comes after 'river'? stone, river, cloud")["input_ids"]])
  logits = lambda m: m(torch.as_tensor(ids)).logits.detach().numpy()  # noqa: E731
  with torch.no_grad():
    want = logits(peft_copy(torch_model, adapter=tmp_path / "adapter"))
    assert np.abs(want - logits(torch_model)).max() > 1e-2
    hf_dir = export.export(str(folder), str(tmp_path / "adapter"), tmp_path / "hf")
    hf_err = np.abs(logits(transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)) - want).max()
    gguf_dir = export.export(str(folder), str(tmp_path / "adapter"), tmp_path / "gguf", fmt="gguf", dtype="float32")
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="model.gguf",
                                                                   dtype=torch.float32)
    gguf_err = np.abs(logits(gguf_model) - want).max()
  print(f"DoRA export vs peft: HF {hf_err:.1e} GGUF {gguf_err:.1e}")
  assert hf_err <= 1e-3 and gguf_err <= 1e-3
