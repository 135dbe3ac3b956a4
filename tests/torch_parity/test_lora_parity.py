"""Checks 3, 4, 5: LoRA loss and gradients against peft; PEFT files both ways; accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxsft import lora, loss
from parity_utils import (batch_of, grad_rel_err, jax_sums, jax_sums_and_lora_grads, model_inputs,
                          peft_copy, peft_named_grads, randomize_lora_b, set_peft_weights, torch_logits,
                          torch_lora_grads, torch_nll_sum64, within_float32_floor)

LORA = {"r": 4, "alpha": 8, "target_modules": ("q_proj", "v_proj", "down_proj")}


def torch_loss_and_grads(peft_model, batch):
  peft_model.zero_grad()
  nll, count = torch_nll_sum64(torch_logits(peft_model, batch), batch["labels"])
  loss64 = nll / count
  loss64.backward()
  return loss64.item(), torch_lora_grads(peft_model)


@pytest.mark.parametrize("which, rslora", [pytest.param("smollm2", False, marks=pytest.mark.slow),
                                           ("tiny_llama", False), ("tiny_llama", True), ("tiny_qwen2", True)])
@pytest.mark.slow
def test_lora_loss_and_gradients_match_peft(which, rslora, request, examples):
  torch_model, jax_model = request.getfixturevalue(which)
  model = randomize_lora_b(lora.apply_lora(nnx.clone(jax_model), rslora=rslora, **LORA))
  peft_model = peft_copy(torch_model, dict(r=LORA["r"], lora_alpha=LORA["alpha"], use_rslora=rslora,
                                           target_modules=list(LORA["target_modules"]), lora_dropout=0.0))
  set_peft_weights(peft_model, lora.adapter_tensors(model))  # identical A and B on both sides
  batch = batch_of(examples[:2])

  t_loss, t_grads = torch_loss_and_grads(peft_model, batch)
  (nll, count), grads = jax_sums_and_lora_grads(model, model_inputs(batch), batch["labels"])
  j_loss = float(nll) / int(count)
  j_grads = peft_named_grads(model, loss.normalize_by_valid(grads, count))
  assert sorted(j_grads) == sorted(t_grads)
  err = grad_rel_err(j_grads, t_grads)
  print(f"loss {t_loss:.5f} |Δloss|={abs(j_loss - t_loss):.1e} LoRA grad rel err {err:.1e}")
  assert abs(j_loss - t_loss) <= 1e-4 * abs(t_loss)
  assert err <= 1e-4


@pytest.mark.slow
def test_adapter_round_trips_between_jaxsft_and_peft(pair, examples, tmp_path):
  torch_model, jax_model = pair
  batch = batch_of(examples[2:4], buckets=(96, 128))

  # jaxsft -> PEFT files -> peft in torch
  model = randomize_lora_b(lora.apply_lora(nnx.clone(jax_model), r=8, alpha=16, target_modules="all-linear",
                                           seed=1), scale=0.02)
  lora.save_adapter(model, tmp_path / "from_jax", base_model_name_or_path="smollm2-135m-instruct")
  peft_model = peft_copy(torch_model, adapter=tmp_path / "from_jax")
  with torch.no_grad():
    nll, count = torch_nll_sum64(torch_logits(peft_model, batch), batch["labels"])
  j_nll, j_count = jax_sums(model, model_inputs(batch), batch["labels"])
  base_nll, _ = jax_sums(jax_model, model_inputs(batch), batch["labels"])
  # the adapter moves the mean loss by > 100x the tolerance below: the check can see a lost adapter
  assert abs(float(base_nll) - float(j_nll)) / int(j_count) > 1e-3
  print(f"jaxsft->peft |Δloss|={abs(float(j_nll) / int(j_count) - nll.item() / count):.1e}")
  assert abs(float(j_nll) / int(j_count) - nll.item() / count) <= 1e-5

  # peft in torch (random A and B, rsLoRA) -> PEFT files -> jaxsft
  torch.manual_seed(3)
  made_by_peft = peft_copy(torch_model, dict(r=4, lora_alpha=32, use_rslora=True, init_lora_weights=False,
                                             target_modules=["k_proj", "o_proj", "up_proj"]))
  made_by_peft.save_pretrained(tmp_path / "from_peft")
  with torch.no_grad():
    nll, count = torch_nll_sum64(torch_logits(made_by_peft, batch), batch["labels"])
  loaded = lora.load_adapter(nnx.clone(jax_model), tmp_path / "from_peft")
  assert loaded.lora_settings.target_modules == ("k_proj", "o_proj", "up_proj")
  assert loaded.lora_settings.scale == 32 / 2
  j_nll, j_count = jax_sums(loaded, model_inputs(batch), batch["labels"])
  print(f"peft->jaxsft |Δloss|={abs(float(j_nll) / int(j_count) - nll.item() / count):.1e}")
  assert abs(float(j_nll) / int(j_count) - nll.item() / count) <= 1e-5


@pytest.mark.parametrize("pair_name", [pytest.param("smollm2", marks=pytest.mark.slow), "tiny_llama", "tiny_qwen2"])
def test_accumulation_equals_full_batch_and_torch(pair_name, request, examples):
  torch_model, jax_model = request.getfixturevalue(pair_name)
  model = randomize_lora_b(lora.apply_lora(nnx.clone(jax_model), **LORA))
  feats = sorted(examples[:24], key=lambda f: len(f["input_ids"]))[:8]  # short rows keep it cheap
  full = batch_of(feats, buckets=(64, 96, 128))
  (nll, count), grads = jax_sums_and_lora_grads(model, model_inputs(full), full["labels"])
  full_loss, full_grads = loss.normalize_by_valid((nll, grads), count)

  sums, grad_sum = [], None
  for i in range(8):  # micro-batches of one row, each at its own bucket
    micro = batch_of(feats[i:i + 1], buckets=(64, 96, 128))
    (m_nll, m_count), m_grads = jax_sums_and_lora_grads(model, model_inputs(micro), micro["labels"])
    sums.append((m_nll, m_count))
    grad_sum = m_grads if grad_sum is None else jax.tree.map(jnp.add, grad_sum, m_grads)
  total_nll, total_count = loss.combine_sums(sums)
  acc_loss, acc_grads = loss.normalize_by_valid((total_nll, grad_sum), total_count)
  assert int(total_count) == int(count)
  acc_err = grad_rel_err(acc_grads, full_grads)
  print(f"accumulated vs full: loss {abs(float(acc_loss) - float(full_loss)):.1e} grads {acc_err:.1e}")
  assert abs(float(acc_loss) - float(full_loss)) <= 1e-6 * float(full_loss)

  peft_model = peft_copy(torch_model, dict(r=LORA["r"], lora_alpha=LORA["alpha"],
                                           target_modules=list(LORA["target_modules"]), lora_dropout=0.0))
  set_peft_weights(peft_model, lora.adapter_tensors(model))
  t_loss, t_grads = torch_loss_and_grads(peft_model, full)  # Σ nll / global valid count
  err = grad_rel_err(peft_named_grads(model, acc_grads), t_grads)
  print(f"accumulated vs torch: |Δloss| {abs(float(acc_loss) - t_loss):.1e} grads {err:.1e}")
  assert abs(float(acc_loss) - t_loss) <= 1e-5
  assert err <= 1e-4
  # a mean of per-micro-batch means is a different number
  mean_of_means = np.mean([float(s) / int(c) for s, c in sums])
  assert abs(mean_of_means - t_loss) > 1e-4
  # last: 8 micro-batches at their own buckets vs one 8-row batch reorder the float32 sums;
  # on the real model that noise is ~1e-6 (see parity_utils.REAL_MODEL_GRAD_TOL)
  within_float32_floor(pair_name, acc_err)
