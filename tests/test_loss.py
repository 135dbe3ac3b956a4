"""jaxsft.loss against a float64 numpy reference; chunked vs plain; accumulation arithmetic."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsft import loss


def reference_sums(logits, labels):
  """float64 numpy: Σ over shifted valid positions of logsumexp(z) - z[y], and the count."""
  z = np.asarray(logits, np.float64)[:, :-1]
  y = np.asarray(labels)[:, 1:]
  valid = y != -100
  m = z.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  picked = np.take_along_axis(z, np.where(valid, y, 0)[..., None], -1)[..., 0]
  return float(np.where(valid, lse - picked, 0).sum()), int(valid.sum())


def random_batch(seed, b=3, t=7, v=11, p_ignore=0.4, dtype=np.float32):
  rng = np.random.default_rng(seed)
  logits = (rng.normal(size=(b, t, v)) * 3).astype(dtype)
  labels = rng.integers(0, v, size=(b, t)).astype(np.int32)
  labels[rng.random((b, t)) < p_ignore] = -100
  return logits, labels


@hypothesis.settings(deadline=None, max_examples=25)
@hypothesis.given(seed=st.integers(0, 2**31), b=st.integers(1, 4), t=st.integers(1, 9),
                  v=st.integers(2, 17), p=st.floats(0.0, 1.0))
@pytest.mark.slow
def test_cross_entropy_sum_matches_float64_reference(seed, b, t, v, p):
  logits, labels = random_batch(seed, b, t, v, p)
  nll_sum, n_valid = jax.jit(loss.cross_entropy_sum)(logits, labels)
  ref_sum, ref_n = reference_sums(logits, labels)
  assert int(n_valid) == ref_n
  np.testing.assert_allclose(float(nll_sum), ref_sum, rtol=1e-6, atol=1e-5)
  mean = float(loss.masked_cross_entropy(logits, labels))
  np.testing.assert_allclose(mean, ref_sum / max(ref_n, 1), rtol=1e-6, atol=1e-6)


def test_gradient_is_softmax_minus_onehot_over_valid_count():
  logits, labels = random_batch(1, b=2, t=5, v=6)
  labels[1] = -100  # a fully masked row
  grad = jax.grad(loss.masked_cross_entropy)(jnp.asarray(logits), labels)
  z = logits[:, :-1].astype(np.float64)
  y = labels[:, 1:]
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  onehot = np.eye(z.shape[-1])[np.where(y == -100, 0, y)]
  valid = (y != -100)[..., None]
  expected = np.zeros_like(logits, np.float64)
  expected[:, :-1] = np.where(valid, p - onehot, 0) / valid.sum()
  np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-7)
  assert np.all(np.asarray(grad)[1] == 0)


def test_nothing_valid_gives_zero_with_finite_zero_gradients():
  logits, labels = random_batch(2)
  labels[:] = -100
  value, grad = jax.value_and_grad(loss.masked_cross_entropy)(jnp.asarray(logits), labels)
  assert float(value) == 0.0
  assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad) == 0)
  h = jnp.ones((2, 4, 3))
  e = jnp.ones((5, 3))
  lab = jnp.full((2, 4), -100)
  f = lambda h, e: loss.normalize_by_valid(*loss.chunked_cross_entropy_sum(h, e, lab, chunk_size=3))
  value, grads = jax.value_and_grad(f, argnums=(0, 1))(h, e)
  assert float(value) == 0.0
  assert all(np.all(np.asarray(g) == 0) for g in grads)


def test_bfloat16_logits_use_float32_log_softmax():
  logits, labels = random_batch(3, v=50)
  bf16 = jnp.asarray(logits, jnp.bfloat16)
  nll_sum, _ = loss.cross_entropy_sum(bf16, labels)
  assert nll_sum.dtype == jnp.float32
  ref_sum, _ = reference_sums(np.asarray(bf16.astype(jnp.float32)), labels)
  np.testing.assert_allclose(float(nll_sum), ref_sum, rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 1000])
def test_chunked_matches_plain_value_and_gradients(chunk_size):
  rng = np.random.default_rng(4)
  b, t, h, v = 3, 9, 8, 37
  hidden = jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32)
  emb = jnp.asarray(rng.normal(size=(v, h)), jnp.float32)
  labels = rng.integers(0, v, size=(b, t)).astype(np.int32)
  labels[rng.random((b, t)) < 0.3] = -100
  labels[2] = -100

  def plain(hd, e):
    return loss.normalize_by_valid(*loss.cross_entropy_sum(hd @ e.T, labels))

  def chunked(hd, e):
    return loss.normalize_by_valid(*loss.chunked_cross_entropy_sum(hd, e, labels, chunk_size=chunk_size))

  with jax.default_matmul_precision("highest"):
    v1, g1 = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(hidden, emb)
    v2, g2 = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, emb)
  np.testing.assert_allclose(float(v2), float(v1), rtol=1e-6)
  for a, c in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-6, atol=1e-7)
  assert int(loss.chunked_cross_entropy_sum(hidden, emb, labels, chunk_size=chunk_size)[1]) == \
      int(loss.cross_entropy_sum(hidden @ emb.T, labels)[1])


def test_chunked_never_builds_full_logits():
  b, t, h, v = 4, 256, 16, 4096
  f = lambda hd, e, y: loss.chunked_cross_entropy_sum(hd, e, y, chunk_size=64)[0]
  g = lambda hd, e, y: loss.cross_entropy_sum(hd @ e.T, y)[0]
  args = (jax.ShapeDtypeStruct((b, t, h), jnp.float32), jax.ShapeDtypeStruct((v, h), jnp.float32),
          jax.ShapeDtypeStruct((b, t), jnp.int32))
  full = b * t * v * 4
  mem_chunked = jax.jit(jax.grad(f, argnums=(0, 1))).lower(*args).compile().memory_analysis()
  mem_plain = jax.jit(jax.grad(g, argnums=(0, 1))).lower(*args).compile().memory_analysis()
  assert mem_plain.temp_size_in_bytes >= full
  assert mem_chunked.temp_size_in_bytes < full / 4


def test_accumulated_sums_equal_full_batch_mean_and_gradient():
  """8 micro-batches of 1 row, normalized by the global count == one batch of 8 rows."""
  rng = np.random.default_rng(5)
  b, t, v = 8, 6, 13
  logits = jnp.asarray(rng.normal(size=(b, t, v)), jnp.float32)
  labels = rng.integers(0, v, size=(b, t)).astype(np.int32)
  labels[rng.random((b, t)) < 0.5] = -100
  labels[3] = -100
  full_value, full_grad = jax.value_and_grad(loss.masked_cross_entropy)(logits, labels)

  sums, grads = [], []
  for i in range(b):
    (nll, n), g = jax.value_and_grad(loss.cross_entropy_sum, has_aux=True)(logits[i:i + 1], labels[i:i + 1])
    sums.append((nll, n))
    grads.append(g)
  nll_total, n_total = loss.combine_sums(sums)
  value, grad = loss.normalize_by_valid((nll_total, jnp.concatenate(grads)), n_total)
  assert int(n_total) == int(loss.cross_entropy_sum(logits, labels)[1])
  np.testing.assert_allclose(float(value), float(full_value), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(full_grad), rtol=1e-6, atol=1e-8)
  # The mean of per-micro-batch means differs whenever the counts differ.
  mean_of_means = np.mean([float(s / max(int(n), 1)) for s, n in sums])
  assert abs(mean_of_means - float(full_value)) > 1e-3


def test_per_example_nll_by_segment():
  logits, labels = random_batch(6, b=2, t=8, v=9, p_ignore=0.0)
  seg = np.array([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
  labels[0, 3] = -100  # first label of segment 2
  labels[0, 6:] = -100  # padding
  labels[:, 0] = -100
  nll, n = loss.per_example_nll(logits, labels, seg, num_segments=2)
  ref_a = reference_sums(logits[:1, 0:3], labels[:1, 0:3])
  ref_b = reference_sums(logits[:1, 3:6], labels[:1, 3:6])
  np.testing.assert_allclose(np.asarray(nll)[0, 1:], [ref_a[0], ref_b[0]], rtol=1e-6)
  assert np.asarray(n)[0].tolist() == [0, ref_a[1], ref_b[1]]
  row_nll, row_n = loss.per_example_nll(logits, labels)
  np.testing.assert_allclose(np.asarray(row_nll), np.asarray(nll).sum(-1), rtol=1e-6)
  assert np.asarray(row_n).tolist() == np.asarray(n).sum(-1).tolist()


def test_combine_sums_rejects_empty():
  with pytest.raises(ValueError, match="no"):
    loss.combine_sums([])


@pytest.mark.parametrize("argnums", [(0, 1), (0,), (1,)])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1000])
@pytest.mark.parametrize("p_ignore", [0.0, 0.6, 1.0])
def test_trained_positions_loss_matches_plain_value_and_gradients(chunk_size, argnums, p_ignore):
  """Only trained positions get logits; all-trained batches (more than any fixed capacity) and
  nothing-trained batches included: the same sum, count and gradients as every position,
  whichever of hidden states and embedding is differentiated (the gradients are computed in
  the forward pass, each only when asked for)."""
  rng = np.random.default_rng(7)
  b, t, h, v = 3, 11, 8, 37
  hidden = jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32)
  emb = jnp.asarray(rng.normal(size=(v, h)), jnp.float32)
  labels = rng.integers(0, v, size=(b, t)).astype(np.int32)
  labels[rng.random((b, t)) < p_ignore] = -100

  def plain(hd, e):
    return loss.normalize_by_valid(*loss.cross_entropy_sum(hd @ e.T, labels))

  def trained(hd, e):
    return loss.normalize_by_valid(*loss.trained_cross_entropy_sum(hd, e, labels, chunk_size=chunk_size))

  with jax.default_matmul_precision("highest"):
    v1, g1 = jax.jit(jax.value_and_grad(plain, argnums=argnums))(hidden, emb)
    v2, g2 = jax.jit(jax.value_and_grad(trained, argnums=argnums))(hidden, emb)
  np.testing.assert_allclose(float(v2), float(v1), rtol=1e-6)
  assert len(g2) == len(argnums)
  for a, c in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-5, atol=1e-7)
  if 0 in argnums:  # untrained positions get exactly zero gradient
    untrained = np.concatenate([labels[:, 1:] == -100, np.ones((b, 1), bool)], axis=1)
    assert np.all(np.asarray(g2[0])[untrained] == 0)
  assert int(loss.trained_cross_entropy_sum(hidden, emb, labels, chunk_size=chunk_size)[1]) == \
      int(loss.cross_entropy_sum(hidden @ emb.T, labels)[1])


def test_trained_positions_loss_computes_no_embedding_gradient_for_a_frozen_embedding():
  """With LoRA the LM head is frozen: differentiating the hidden states alone runs no (V, H)
  gradient product, and no chunk's (chunk, V) logits are kept for the backward pass."""
  rng = np.random.default_rng(3)
  b, t, h, v = 2, 16, 8, 37
  hidden = jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32)
  emb = jnp.asarray(rng.normal(size=(v, h)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)

  def program(argnums):
    f = jax.jit(jax.grad(lambda hd, e: loss.trained_cross_entropy_sum(hd, e, labels, chunk_size=8)[0], argnums))
    return f.lower(hidden, emb).compile().as_text()

  produced = lambda text, shape: [line for line in text.splitlines()
                                  if f"= f32[{shape}]" in line and " parameter(" not in line]
  assert produced(program((0, 1)), f"{v},{h}")  # the check can see an embedding gradient
  assert not produced(program(0), f"{v},{h}")


def test_trained_positions_loss_skips_chunks_without_a_trained_label():
  """The LM head matmul sits in a `cond` per chunk: XLA's program has a conditional, and the
  hidden state of an untrained position past the last trained chunk never reaches the head
  (a NaN there leaves the sums and the embedding gradient finite)."""
  rng = np.random.default_rng(1)
  b, t, h, v = 2, 16, 8, 13
  hidden = np.asarray(rng.normal(size=(b, t, h)), np.float32)
  emb = jnp.asarray(rng.normal(size=(v, h)), jnp.float32)
  labels = np.full((b, t), -100, np.int32)
  labels[0, 1:4] = rng.integers(0, v, 3)  # 3 trained positions: one chunk of 4
  hidden[1, 5:] = np.nan  # untrained, sorted past the first chunk
  f = jax.jit(jax.value_and_grad(lambda hd, e, y: loss.trained_cross_entropy_sum(hd, e, y, chunk_size=4)[0],
                                 argnums=(0, 1)))
  assert "conditional" in f.lower(hidden, emb, labels).compile().as_text()
  value, (g_hidden, g_emb) = f(jnp.asarray(hidden), emb, labels)
  assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(g_emb)))
  plain = jax.grad(lambda e: loss.cross_entropy_sum(jnp.asarray(hidden) @ e.T, labels)[0])(emb)
  assert not np.all(np.isfinite(np.asarray(plain)))  # every position's logits: the NaN reaches E
