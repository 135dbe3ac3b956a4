"""Checks 2, 6, 7: whole-model logits and loss against transformers; padding; packing."""

import numpy as np
import pytest
import torch

from jaxsft import loss
from parity_utils import (PAD, batch_of, grad_rel_err, jax_logits, jax_sums, model_inputs, pack, packed_example_losses,
                          torch_logits, torch_nll_sum64, torch_row_losses, within_float32_floor)


def real_token_logit_gap(t_logits, j_logits, mask):
  real = np.asarray(mask) == 1
  return float(np.abs(t_logits.detach().numpy()[real] - np.asarray(j_logits)[real]).max())


@pytest.mark.slow
@pytest.mark.parametrize("which", ["alpaca", "multiturn"])
def test_loss_and_logits_match_transformers(pair, which, examples, multiturn_examples):
  torch_model, jax_model = pair
  # multi-turn rows are all truncated to 128: a fill row (fully masked) adds the padding
  batch = batch_of(examples[:4]) if which == "alpaca" else batch_of(multiturn_examples[:3], batch_size=4)
  assert (batch["attention_mask"] == 0).any()  # padded rows in the batch
  with torch.no_grad():
    t_logits = torch_logits(torch_model, batch)
  t_nll, t_count = torch_nll_sum64(t_logits, batch["labels"])
  j_logits = jax_logits(jax_model, model_inputs(batch))
  nll, count = loss.cross_entropy_sum(j_logits, batch["labels"])
  assert int(count) == t_count > 0
  gap = real_token_logit_gap(t_logits, j_logits, batch["attention_mask"])
  delta = abs(float(nll) / int(count) - t_nll.item() / t_count)
  print(f"max|Δlogits|={gap:.2e} |Δloss|={delta:.2e} loss={t_nll.item() / t_count:.4f}")
  assert gap <= 5e-4
  assert delta <= 1e-5


def sums_and_grads(jax_model, batch):
  from parity_utils import jax_sums_and_lora_grads

  return jax_sums_and_lora_grads(jax_model, model_inputs(batch), batch["labels"])


def lora_model(jax_model):
  from flax import nnx

  from jaxsft import lora
  from parity_utils import randomize_lora_b

  return randomize_lora_b(lora.apply_lora(nnx.clone(jax_model), r=4, alpha=8, target_modules="all-linear"))


def assert_same_loss_and_grads(a, b, tol=1e-6):
  (nll_a, n_a), g_a = a
  (nll_b, n_b), g_b = b
  assert int(n_a) == int(n_b)
  loss_err = abs(float(nll_a) - float(nll_b)) / abs(float(nll_b))
  grad_err = grad_rel_err(g_a, g_b)
  print(f"loss rel err {loss_err:.1e}, LoRA grad rel err {grad_err:.1e}")
  assert loss_err <= tol
  assert grad_err <= tol


@pytest.mark.slow
def test_pad_token_does_not_change_loss_or_gradients(pair, examples):
  _, jax_model = pair
  model = lora_model(jax_model)
  feats = examples[:3]
  reference = sums_and_grads(model, batch_of(feats, buckets=(128,)))
  assert_same_loss_and_grads(sums_and_grads(model, batch_of(feats, buckets=(128,), pad=0)), reference)


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_larger_bucket_does_not_change_loss_or_gradients(which, request, examples):
  _, jax_model = request.getfixturevalue(which)
  model = lora_model(jax_model)
  feats = examples[:3]
  (nll, n), grads = sums_and_grads(model, batch_of(feats, buckets=(192,), batch_size=4))
  (ref_nll, ref_n), ref_grads = sums_and_grads(model, batch_of(feats, buckets=(128,)))
  assert int(n) == int(ref_n)
  err = grad_rel_err(grads, ref_grads)
  print(f"{which}: loss rel err {abs(float(nll) - float(ref_nll)) / float(ref_nll):.1e}, grad rel err {err:.1e}")
  assert abs(float(nll) - float(ref_nll)) <= 1e-6 * float(ref_nll)
  within_float32_floor(which, err)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2"])
def test_attention_mask_hides_pads_that_a_causal_mask_would_show(which, request, examples):
  """Left padding puts pads before real tokens, where the causal mask lets them be seen.
  (Tiny models only: same masking code as the real one, and it keeps the suite short.)"""
  _, jax_model = request.getfixturevalue(which)
  model = lora_model(jax_model)
  feats = examples[:3]
  right = batch_of(feats, buckets=(128,))
  right["positions"] = np.broadcast_to(np.arange(128, dtype=np.int32), (3, 128)).copy()
  left = {k: np.zeros_like(v) for k, v in right.items()}
  for r, f in enumerate(feats):
    n = len(f["input_ids"])
    for k in right:
      left[k][r] = np.roll(right[k][r], 128 - n)
  for pad in (PAD, 0):
    left["input_ids"][left["attention_mask"] == 0] = pad
    assert_same_loss_and_grads(sums_and_grads(model, left), sums_and_grads(model, right))
  # without the attention mask the pads are seen: the loss moves by far more than the 1e-6
  # tolerance above, so that comparison would catch an ignored mask
  unmasked = dict(left, attention_mask=np.ones_like(left["attention_mask"]))
  nll_unmasked = float(jax_sums(model, model_inputs(unmasked), unmasked["labels"])[0])
  nll_left = float(jax_sums(model, model_inputs(left), left["labels"])[0])
  assert abs(nll_unmasked - nll_left) > 1e-4 * abs(nll_left)


@pytest.mark.slow
def test_packed_rows_give_the_per_example_losses_of_unpacked_rows(pair, examples):
  torch_model, jax_model = pair
  feats = sorted(examples[:12], key=lambda f: len(f["input_ids"]))[:6]  # short ones pack
  packed = pack(feats, 256)
  assert packed["segment_ids"].max() >= 2  # at least one row holds several examples
  unpacked = batch_of(feats, buckets=(128,))

  packed_losses = packed_example_losses(jax_model, packed)
  # unpacked labels keep their first label; it is never predicted (no position before it)
  row_nll, row_n = loss.per_example_nll(jax_logits(jax_model, model_inputs(unpacked)), unpacked["labels"])
  unpacked_losses = [float(a) / int(b) for a, b in zip(row_nll, row_n)]
  np.testing.assert_allclose(packed_losses, unpacked_losses, rtol=1e-5)

  np.testing.assert_allclose(packed_losses, torch_row_losses(torch_model, unpacked), rtol=1e-5)
