"""A decoder projection: its frozen base product, its LoRA branch and the DoRA form.

`Linear` holds the weight as `kernel` (in, out) (y = x @ kernel), the transpose of PyTorch's
`nn.Linear.weight`, with a leading layer axis (L, ...) in the stacked decoder. LoRA factors,
when `jaxsft.lora.apply_lora` adds them, live on it as `nnx.LoRAParam` `lora_a` (in, r) and
`lora_b` (r, out), stacked per layer too. The base product is `jaxsft.matmul.matmul` (16-bit
kernels on a CPU with bf16 units); a quantized kernel is dequantized first (`jaxsft.quant`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsft.matmul import matmul
from jaxsft.quant.kernel import kernel_value


@jax.custom_vjp
def low_rank_product(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """(x @ a) @ b for x (..., in), a (in, r), b (r, out): the LoRA branch.

  Its backward pass is autodiff's, with the weight gradients' products written so that the
  transposed operand is the rank-r one:
    ∂a = xᵀ (g bᵀ),   ∂b = ((g)ᵀ (x a))ᵀ,   ∂x = (g bᵀ) aᵀ
  (autodiff writes ∂b = (x a)ᵀ g, for which XLA on a CPU transposes the (tokens, out) gradient
  g, fused with whatever produced it, before an unblocked product).
  """
  return (x @ a) @ b


def _low_rank_fwd(x, a, b):
  xa = x @ a
  return xa @ b, (x, a, b, xa)


def _low_rank_bwd(residuals, g):
  x, a, b, xa = residuals
  tokens = lambda t: t.reshape(-1, t.shape[-1])
  g_xa = g @ b.T
  contract_tokens = (((0,), (0,)), ((), ()))
  grad_a = jax.lax.dot_general(tokens(x), tokens(g_xa), contract_tokens)  # (in, r)
  grad_b = jax.lax.dot_general(tokens(g), tokens(xa), contract_tokens).T  # (out, r)ᵀ
  return g_xa @ a.T, grad_a.astype(a.dtype), grad_b.astype(b.dtype)


low_rank_product.defvjp(_low_rank_fwd, _low_rank_bwd)


class Linear(nnx.Module):
  """y = x @ kernel (+ bias) (+ scale * dropout(x) @ lora_a @ lora_b), or its DoRA form.

  LoRA factors are `nnx.LoRAParam`s set by `jaxsft.lora.apply_lora` (None when absent); they
  stay float32 and are cast to the activations' dtype at use, like PEFT's autocast of adapters.

  DoRA (`lora_magnitude` (out,) set too), as peft's `DoraLinearLayer` computes it, with
  x_d = dropout(x) (x itself without dropout) and W = kernel (in, out):

      n = ‖W + s·A B‖ over the input axis (one norm per output; constant: no gradient),
      g = m / n,
      y = x W + (g − 1) ⊙ (x_d W) + g ⊙ s · x_d A B (+ bias)

  which without dropout is g ⊙ (x W + s · x A B) (+ bias): the adapted weight's columns
  rescaled to the trained magnitude m.
  """

  def __init__(self, in_features: int, out_features: int, *, bias: bool, stack: tuple[int, ...],
               dtype, rng_index: int, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.kernel = nnx.Param(init(rngs.params(), (*stack, in_features, out_features), dtype))
    self.bias = nnx.Param(jnp.zeros((*stack, out_features), dtype)) if bias else None
    self.dtype = jnp.dtype(dtype)  # a quantized kernel is dequantized to it
    # data (not static) attributes: `apply_lora` later puts LoRAParams here
    self.lora_a: nnx.LoRAParam | None = nnx.data(None)
    self.lora_b: nnx.LoRAParam | None = nnx.data(None)
    self.lora_magnitude: nnx.LoRAParam | None = nnx.data(None)  # DoRA's m, (out,) per layer
    self.lora_scale = 0.0
    self.lora_dropout = 0.0
    self.rng_index = rng_index  # folds the layer's dropout key into a per-projection key

  def __call__(self, x: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
    kernel = kernel_value(self.kernel, self.dtype)  # a quantized base is dequantized here (jaxsft.quant)
    base = matmul(x, kernel)
    y = base if self.bias is None else base + self.bias[...].astype(base.dtype)
    if self.lora_a is not None:
      lora_x = x
      if dropout_rng is not None and self.lora_dropout > 0.0:
        keep = 1.0 - self.lora_dropout
        key = jax.random.fold_in(dropout_rng, self.rng_index)
        lora_x = jnp.where(jax.random.bernoulli(key, keep, x.shape), x / keep, 0).astype(x.dtype)
      a = self.lora_a[...].astype(x.dtype)
      b = self.lora_b[...].astype(x.dtype)
      lora = low_rank_product(lora_x, a, b) * jnp.asarray(self.lora_scale, x.dtype)
      if self.lora_magnitude is None:
        y = y + lora
      else:
        g = dora_column_scale(kernel, self.lora_a[...], self.lora_b[...], self.lora_scale,
                              self.lora_magnitude[...]).astype(x.dtype)
        base_d = base if lora_x is x else matmul(lora_x, kernel)  # peft reruns the base product on x_d
        y = y + (g - 1) * base_d + g * lora  # peft's order of the sums
    return y


def dora_column_scale(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float, magnitude: jax.Array) -> jax.Array:
  """g = m / ‖W + s·A B‖ (norm over the input axis, in float32), with the norm a constant of
  the gradient (peft detaches it, as the DoRA paper's section 4.3 advises): (out,)."""
  return magnitude / jax.lax.stop_gradient(dora_weight_norm(kernel, a, b, scale))


def dora_weight_norm(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """‖W + s·A B‖₂ over the input axis (−2) of a (…, in, out) kernel, in float32: (…, out)."""
  delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return jnp.linalg.norm(kernel.astype(jnp.float32) + scale * delta, axis=-2)
