"""The quantized-kernel variable and its reads: all that a model's projections, embeddings and
LM head need of `jaxsft.quant` (`jaxsft.quant.model` quantizes a whole model; it builds on the
model, which builds on this).

A quantized embedding table (V, H) is stored as the kernel of the LM head's matmul, (H, V):
blocks run along the hidden size of one token's row, as a GGUF's `token_embd` blocks do, so
`h @ kernel` gives the logits and column v is token v's embedding.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxsft.quant import formats
from jaxsft.quant.formats import QuantizedTensor


class QuantizedKernel(nnx.Variable):
  """A frozen, block-quantized kernel (a `QuantizedTensor` value); never trained."""


def kernel_value(variable: nnx.Variable, dtype) -> jax.Array:
  """The kernel as a float array: dequantized (float32 math, then `dtype`) when quantized."""
  value = variable.get_value()
  if isinstance(value, QuantizedTensor):
    return formats.dequantize(value, dtype)
  return value


def table_value(variable: nnx.Variable, dtype) -> jax.Array:
  """An embedding table (V, H) as a float array (a quantized one is stored (H, V)).

  A quantized table is dequantized straight into (V, H), the layout of a float table, and
  materialized once (`optimization_barrier`): with a transpose of the (H, V) result XLA folds
  it into the LM head's matmuls, which then sum in another order than on a float table (the
  loss and gradients stop equalling the float path's on the same weights), and without the
  barrier it fuses the dequantization into every chunk's matmul."""
  value = variable.get_value()
  if isinstance(value, QuantizedTensor):
    return jax.lax.optimization_barrier(formats.dequantize(value, dtype, transposed=True))
  return value


def table_rows(variable: nnx.Variable, ids: jax.Array, dtype) -> jax.Array:
  """Rows `ids` (any shape) of an embedding table: (*ids.shape, H). A quantized table
  dequantizes only the rows looked up."""
  value = variable.get_value()
  if not isinstance(value, QuantizedTensor):
    return jax.numpy.take(value, ids, axis=0)
  rows = formats.dequantize(formats.take_columns(value, ids.reshape(-1)), dtype, transposed=True)  # (n, H)
  return rows.reshape(*ids.shape, rows.shape[-1])
