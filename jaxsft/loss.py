"""Masked next-token cross-entropy as sums, so every normalization is explicit.

Labels follow the Hugging Face convention: `labels` is aligned with `input_ids` and the loss
shifts inside (logits at t predict the label at t + 1); `-100` marks a position that is not
trained. Every function returns or consumes `(nll_sum, n_valid)` pairs: a step's loss over
gradient-accumulation micro-batches and data-parallel shards is

  loss = Σ_micro Σ_t nll_t / Σ_micro Σ_t valid_t

(the global count), never a mean of per-micro-batch means. `normalize_by_valid` is that
division for the trainer's step (`jaxsft.step`) and the tests; `combine_sums` adds the pairs.

Pure functions over arrays; jittable; log-softmax in float32 whatever the logits' dtype; zero
loss with finite zero gradients when nothing is valid.
"""

from __future__ import annotations

from collections.abc import Iterable
import functools

import jax
import jax.numpy as jnp

from jaxsft.labels import IGNORE_INDEX  # re-exported: jaxsft.loss.IGNORE_INDEX
from jaxsft.matmul import matmul, matmul_t


def _shift(logits_or_hidden: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Position t predicts the label at t + 1: drop the last prediction and the first label."""
  return logits_or_hidden[:, :-1], labels[:, 1:]


def _flat_shifted(hidden: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(B*(T-1), H) hidden states and their (B*(T-1),) next-token targets."""
  hidden, targets = _shift(hidden, labels)
  return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)


def _token_nll(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-token negative log-likelihood and validity mask (nll is 0 where invalid).

  nll_t = logsumexp(z_t) - z_t[y_t], computed in float32.
  """
  valid = targets != IGNORE_INDEX
  logits = logits.astype(jnp.float32)
  safe_targets = jnp.where(valid, targets, 0)  # -100 would index out of range
  target_logit = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
  nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
  # `where` (not multiply): an invalid position contributes an exact zero, gradient included.
  return jnp.where(valid, nll, 0.0), valid


def cross_entropy_sum(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Summed next-token cross-entropy and the number of trained positions.

  With z = logits (B, T, V) and y = labels (B, T):

    nll_sum = Σ_{b, t < T-1, y[b, t+1] != -100} logsumexp(z[b, t]) - z[b, t, y[b, t+1]]
    n_valid = #{(b, t) : y[b, t+1] != -100}

  Args:
    logits: (B, T, V) in any float dtype; upcast to float32 here.
    labels: (B, T) int, aligned with the inputs, -100 where not trained.

  Returns:
    `(nll_sum, n_valid)`: float32 scalar and int32 scalar.
  """
  nll, valid = _token_nll(*_shift(logits, labels))
  return nll.sum(), valid.sum(dtype=jnp.int32)


def masked_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy over trained positions: nll_sum / max(n_valid, 1).

  Equal to `torch.nn.functional.cross_entropy(shifted_logits, shifted_labels,
  ignore_index=-100)` when anything is valid, and 0 (with zero gradients) when nothing is.
  """
  return normalize_by_valid(*cross_entropy_sum(logits, labels))


def per_example_nll(logits: jax.Array, labels: jax.Array,
                    segment_ids: jax.Array | None = None,
                    num_segments: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Summed nll and valid count per row, or per (row, segment) for packed rows.

  For packed rows the label at t + 1 belongs to the segment of position t + 1 (the first label
  of every segment is -100, so no prediction crosses a segment boundary).

  Returns:
    `(nll, n_valid)` of shape (B,) or, with `segment_ids`, (B, num_segments + 1) indexed by
    segment id (column 0 is padding and stays 0).
  """
  nll, valid = _token_nll(*_shift(logits, labels))
  if segment_ids is None:
    return nll.sum(axis=-1), valid.sum(axis=-1, dtype=jnp.int32)
  if num_segments is None:
    raise ValueError("per_example_nll: num_segments is required with segment_ids (a static size)")
  one_hot = jax.nn.one_hot(segment_ids[:, 1:], num_segments + 1, dtype=jnp.float32)
  return (jnp.einsum("bt,bts->bs", nll, one_hot),
          jnp.einsum("bt,bts->bs", valid.astype(jnp.float32), one_hot).astype(jnp.int32))


def normalize_by_valid(tree, n_valid: jax.Array):
  """Divide a summed loss (or a pytree of summed gradients) by max(n_valid, 1).

  The same scale applies to the loss and to every gradient leaf, so accumulating sums over
  micro-batches and normalizing once gives the full-batch mean and its gradient.
  """
  count = jnp.maximum(jnp.asarray(n_valid, jnp.float32), 1.0)

  def scale_leaf(x):
    x = jnp.asarray(x)
    return (x / count).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x / count

  return jax.tree.map(scale_leaf, tree)


def combine_sums(pairs: Iterable[tuple[jax.Array, jax.Array]]) -> tuple[jax.Array, jax.Array]:
  """Σ nll_sum and Σ n_valid over micro-batches or shards: `(Σ_i nll_i, Σ_i n_i)`."""
  pairs = list(pairs)
  if not pairs:
    raise ValueError("combine_sums: no (nll_sum, n_valid) pairs")
  nll = functools.reduce(jnp.add, (jnp.asarray(p[0], jnp.float32) for p in pairs))
  count = functools.reduce(jnp.add, (jnp.asarray(p[1], jnp.int32) for p in pairs))
  return nll, count


def chunked_cross_entropy_sum(hidden: jax.Array, embedding: jax.Array, labels: jax.Array, *,
                              chunk_size: int = 1024) -> tuple[jax.Array, jax.Array]:
  """`cross_entropy_sum(hidden @ embedding.T, labels)` without the (B, T, V) logits.

  The B * (T - 1) predicting positions are flattened and processed `chunk_size` tokens at a
  time by a `lax.scan` whose body is rematerialized (`jax.checkpoint`): forward and backward
  keep only one (chunk_size, V) block of logits alive, instead of B * T * V floats.

  Args:
    hidden: (B, T, H) final-normed hidden states, in the compute dtype.
    embedding: (V, H) output embedding (the LM head), in the compute dtype.
    labels: (B, T), aligned with the inputs, -100 where not trained.
    chunk_size: tokens per chunk; the trailing partial chunk is padded with -100 labels.

  Returns:
    `(nll_sum, n_valid)` as `cross_entropy_sum`.
  """
  hidden, targets = _flat_shifted(hidden, labels)
  n = targets.shape[0]
  chunk_size = max(1, min(chunk_size, n))
  pad = -n % chunk_size
  hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
  targets = jnp.pad(targets, (0, pad), constant_values=IGNORE_INDEX)
  hidden = hidden.reshape(-1, chunk_size, hidden.shape[-1])
  targets = targets.reshape(-1, chunk_size)

  @jax.checkpoint
  def chunk_nll(h, y):
    # Logits in the compute dtype exactly like the model's LM head; upcast in _token_nll.
    nll, valid = _token_nll(matmul_t(h, embedding), y)
    return nll.sum(), valid.sum(dtype=jnp.int32)

  def body(carry, xs):
    nll, count = chunk_nll(*xs)
    return (carry[0] + nll, carry[1] + count), None

  init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
  (nll_sum, n_valid), _ = jax.lax.scan(body, init, (hidden, targets))
  return nll_sum, n_valid


def _chunk_nll_and_grads(h: jax.Array, embedding: jax.Array, y: jax.Array, *, grad_hidden: bool,
                         grad_embedding: bool):
  """Σ nll of one chunk of positions and its gradients, computed together.

  With z = h Eᵀ (chunk, V) and p = softmax(z) in float32, for a trained position
    ∂nll/∂z = p - onehot(y)        (0 where y = -100)
    ∂nll/∂h = (∂nll/∂z) E,   ∂nll/∂E = (∂nll/∂z)ᵀ h
  (the gradient in the compute dtype, like autodiff of `h @ E.T` would give).
  """
  logits = matmul_t(h, embedding)  # in the compute dtype, exactly like the model's LM head
  z = logits.astype(jnp.float32)
  valid = y != IGNORE_INDEX
  safe_targets = jnp.where(valid, y, 0)
  lse = jax.nn.logsumexp(z, axis=-1)
  target_logit = jnp.take_along_axis(z, safe_targets[:, None], axis=-1)[:, 0]
  nll = jnp.where(valid, lse - target_logit, 0.0).sum()
  if not (grad_hidden or grad_embedding):
    return nll, None, None
  one_hot = jnp.arange(z.shape[-1])[None, :] == safe_targets[:, None]
  dz = jnp.where(valid[:, None], jnp.exp(z - lse[:, None]) - one_hot, 0.0).astype(h.dtype)
  dh = matmul(dz, embedding) if grad_hidden else None
  de = matmul(dz.T, h) if grad_embedding else None
  return nll, dh, de


@jax.custom_vjp
def _sorted_chunks_nll(hidden_chunks: jax.Array, embedding: jax.Array, target_chunks: jax.Array,
                       n_valid: jax.Array) -> jax.Array:
  """Σ nll over chunks (C, chunk, H) whose trained positions come first (n_valid of them)."""
  return _sorted_chunks_fwd(hidden_chunks, embedding, target_chunks, n_valid, grads=(False, False))[0]


def _sorted_chunks_fwd(hidden_chunks, embedding, target_chunks, n_valid, *, grads):
  """(Σ nll, (∂/∂hidden_chunks or None, ∂/∂embedding or None)), skipping every chunk past the
  trained positions under a `lax.cond`.

  The gradients are computed beside the loss, so nothing of size (chunk, V) outlives its chunk
  and the backward pass is one multiplication. A Python loop of conds (not a scan): a scan
  would stack every chunk's outputs into one buffer.
  """
  grad_hidden, grad_embedding = grads
  num_chunks, chunk_size, _ = hidden_chunks.shape
  compute = functools.partial(_chunk_nll_and_grads, grad_hidden=grad_hidden, grad_embedding=grad_embedding)

  def skipped(h, e, y):
    zeros = lambda on, like: jnp.zeros_like(like) if on else None
    return jnp.zeros((), jnp.float32), zeros(grad_hidden, h), zeros(grad_embedding, e)

  total = jnp.zeros((), jnp.float32)
  dh_chunks, de = [], None
  for index in range(num_chunks):
    nll, dh, de_chunk = jax.lax.cond(index * chunk_size < n_valid, compute, skipped,
                                     hidden_chunks[index], embedding, target_chunks[index])
    total = total + nll
    dh_chunks.append(dh)
    if grad_embedding:
      de = de_chunk if de is None else de + de_chunk
  dh_all = jnp.stack(dh_chunks) if grad_hidden else None
  return total, (dh_all, de)


def _sorted_chunks_vjp_fwd(hidden_chunks, embedding, target_chunks, n_valid):
  # symbolic_zeros: `.perturbed` says which inputs are differentiated (an embedding that is
  # frozen, as with LoRA, gets no (V, H) gradient computed at all)
  grads = (hidden_chunks.perturbed, embedding.perturbed)
  return _sorted_chunks_fwd(hidden_chunks.value, embedding.value, target_chunks.value, n_valid.value,
                            grads=grads)


def _sorted_chunks_vjp_bwd(residuals, g):
  dh, de = residuals
  scale = lambda x: None if x is None else (g * x.astype(jnp.float32)).astype(x.dtype)
  return scale(dh), scale(de), None, None


_sorted_chunks_nll.defvjp(_sorted_chunks_vjp_fwd, _sorted_chunks_vjp_bwd, symbolic_zeros=True)


def trained_cross_entropy_sum(hidden: jax.Array, embedding: jax.Array, labels: jax.Array, *,
                              chunk_size: int = 256, max_chunks: int = 16) -> tuple[jax.Array, jax.Array]:
  """`cross_entropy_sum(hidden @ embedding.T, labels)` with the LM head only where a label is trained.

  A position whose (shifted) next label is -100 needs neither logits nor a loss. The
  N = B * (T - 1) predicting positions are reordered so the trained ones come first (a stable
  sort: their order is kept), then processed `chunk_size` at a time, each chunk under a
  `lax.cond`: a chunk holds a trained position iff its start is below n_valid, and every chunk
  after that is skipped (no (chunk, H) x (H, V) matmul). Nothing is dropped whatever the batch
  holds (the static chunk count covers all N positions), so

    nll_sum = Σ_{valid (b, t)} logsumexp(h[b, t] Eᵀ) - (h[b, t] Eᵀ)[y[b, t+1]]

  is the same sum as the plain loss (up to float summation order), gradients included: each
  chunk's gradients are computed with its loss (`_chunk_nll_and_grads`), so at most one
  (chunk_size, V) block of logits is alive, forward or backward, at the cost of no extra matmul;
  the gather's transpose scatters each trained position's gradient back to its place and leaves
  exact zeros at the others. The embedding's (V, H) gradient is computed only when it is
  differentiated (full fine-tuning). Works unchanged on packed rows (a segment's first label is
  -100).

  Args:
    hidden: (B, T, H) final-normed hidden states, in the compute dtype.
    embedding: (V, H) output embedding (the LM head), in the compute dtype.
    labels: (B, T), aligned with the inputs, -100 where not trained.
    chunk_size: positions per LM-head matmul; the skip granularity.
    max_chunks: at most this many chunks (larger ones for long batches): the program grows
      with the chunk count.

  Returns:
    `(nll_sum, n_valid)` as `cross_entropy_sum`.
  """
  hidden, targets = _flat_shifted(hidden, labels)
  n = targets.shape[0]
  chunk_size = max(1, min(max(chunk_size, -(-n // max_chunks)), n))
  valid = targets != IGNORE_INDEX
  n_valid = valid.sum(dtype=jnp.int32)
  # Trained positions first, padded with untrained ones to whole chunks.
  order = jnp.argsort(~valid, stable=True)
  pad = -n % chunk_size
  order = jnp.pad(order, (0, pad))
  sorted_targets = jnp.pad(targets, (0, pad), constant_values=IGNORE_INDEX)[order]
  sorted_targets = jnp.where(jnp.arange(n + pad) < n_valid, sorted_targets, IGNORE_INDEX)
  num_chunks = (n + pad) // chunk_size
  sorted_hidden = jnp.take(hidden, order, axis=0).reshape(num_chunks, chunk_size, hidden.shape[-1])
  nll_sum = _sorted_chunks_nll(sorted_hidden, embedding, sorted_targets.reshape(num_chunks, chunk_size), n_valid)
  return nll_sum, n_valid
