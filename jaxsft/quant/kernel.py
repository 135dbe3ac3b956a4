"""The quantized-kernel variable and its read: all that a model's projection needs of
`jaxsft.quant` (`jaxsft.quant.model` quantizes a whole model; it builds on the model, which
builds on this)."""

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
