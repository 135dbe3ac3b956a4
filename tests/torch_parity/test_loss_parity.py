"""Check 1: jaxsft's masked cross-entropy against torch.nn.functional.cross_entropy."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxsft import loss

from parity_utils import batch_of, rel_err


def test_masked_cross_entropy_value_and_gradient_match_torch(examples):
  batch = batch_of(examples[:3], buckets=(128,), batch_size=4)  # row 3 is a fill row: fully masked
  labels = batch["labels"]
  assert (labels[3] == -100).all() and (labels[:3] != -100).any()
  rng = np.random.default_rng(0)
  logits = (rng.normal(size=(*labels.shape, 49152)) * 4).astype(np.float32)

  value, grad = jax.jit(jax.value_and_grad(loss.masked_cross_entropy))(jnp.asarray(logits), labels)

  def torch_ce(dtype):
    t_logits = torch.tensor(logits, dtype=dtype, requires_grad=True)
    value = torch.nn.functional.cross_entropy(t_logits[:, :-1].reshape(-1, 49152),
                                              torch.tensor(labels[:, 1:], dtype=torch.long).reshape(-1),
                                              ignore_index=-100)
    value.backward()
    return value.item(), t_logits.grad.numpy()

  # The reference is torch's cross-entropy in float64: torch's own float32 gradient is ~9e-6
  # (relative, max-norm) away from it on these 49,152-way logits (its exp(z - lse) with a
  # float32 lse of ~20), jaxsft's float32 gradient ~1e-7.
  ref_value, ref_grad = torch_ce(torch.float64)
  f32_value, f32_grad = torch_ce(torch.float32)
  print(f"jaxsft vs torch f64: value {rel_err(value, ref_value):.1e} grad {rel_err(grad, ref_grad):.1e}; "
        f"torch f32 vs f64: value {rel_err(f32_value, ref_value):.1e} grad {rel_err(f32_grad, ref_grad):.1e}")
  assert rel_err(value, ref_value) <= 1e-6
  assert rel_err(grad, ref_grad) <= 1e-6
  assert rel_err(value, f32_value) <= 1e-6  # the values agree in float32 too
  assert np.all(np.asarray(grad)[3] == 0) and np.all(np.asarray(grad)[:, -1] == 0)


def test_nothing_valid_is_zero_where_torch_is_nan():
  logits = jnp.ones((2, 5, 7))
  labels = np.full((2, 5), -100, np.int32)
  value, grad = jax.value_and_grad(loss.masked_cross_entropy)(logits, labels)
  t = torch.nn.functional.cross_entropy(torch.ones(8, 7), torch.full((8,), -100), ignore_index=-100)
  assert torch.isnan(t)  # torch's mean over zero tokens; jaxsft defines it as 0 with zero gradients
  assert float(value) == 0.0 and np.all(np.asarray(grad) == 0)


def test_trained_positions_loss_matches_torch_on_every_position(examples):
  """The step's loss (LM head only at trained positions) against torch's cross-entropy over the
  logits of every position: value and gradients w.r.t. the hidden states and the embedding."""
  batch = batch_of(examples[:3], buckets=(128,), batch_size=4)
  labels = batch["labels"]
  rng = np.random.default_rng(1)
  hidden = (rng.normal(size=(*labels.shape, 64))).astype(np.float32)
  emb = (rng.normal(size=(49152, 64)) * 0.3).astype(np.float32)

  def jax_loss(h, e):
    return loss.normalize_by_valid(*loss.trained_cross_entropy_sum(h, e, labels, chunk_size=128))

  value, (g_h, g_e) = jax.jit(jax.value_and_grad(jax_loss, argnums=(0, 1)))(jnp.asarray(hidden), jnp.asarray(emb))
  t_h = torch.tensor(hidden, dtype=torch.float64, requires_grad=True)
  t_e = torch.tensor(emb, dtype=torch.float64, requires_grad=True)
  logits = t_h @ t_e.T
  ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 49152),
                                          torch.tensor(labels[:, 1:], dtype=torch.long).reshape(-1), ignore_index=-100)
  ref.backward()
  assert rel_err(value, ref.item()) <= 1e-6
  assert rel_err(g_h, t_h.grad.numpy()) <= 1e-5
  assert rel_err(g_e, t_e.grad.numpy()) <= 1e-5
