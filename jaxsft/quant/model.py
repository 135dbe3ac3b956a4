"""A `CausalLM` whose frozen projection kernels are stored block-quantized (QLoRA).

Each decoder projection (`jaxsft.models.linear.Linear`) keeps its stacked kernel (L, in, out)
as a `QuantizedKernel` variable holding a `QuantizedTensor`; `Linear` dequantizes it on use
(`kernel_value`), inside the scanned and rematerialized layer body, so only one layer's float
kernel exists at a time in the forward and in the backward pass. `QuantizedKernel` is not an
`nnx.Param`: the trainer's `nnx.split(model, nnx.LoRAParam, ...)` puts it with the frozen
state, and the optimizer never sees it. The embedding table and LM head are quantized too when
asked (`embeddings=True`, `model.quantize_embeddings`): the lookup dequantizes the rows it
takes, the LM head is dequantized whole for the logits. Norms and biases stay in the compute
dtype (a few thousand weights a layer); LoRA factors stay float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsft.quant import formats
from jaxsft.quant.formats import QuantizedTensor
from jaxsft.quant.kernel import QuantizedKernel, kernel_value, table_value



def projections(model):
  """(dotted path inside the decoder layer, `Linear`) for every projection of `model`: the modules
  of its layers that hold a `kernel` (quant sits below the models, so it finds the decoder's
  `Linear` by what it holds rather than by importing its class)."""
  return [(".".join(map(str, path)), module) for path, module in nnx.iter_graph(model.layers)
          if isinstance(module, nnx.Module) and "kernel" in vars(module)]


def tables(model):
  """(name, variable) of `model`'s embedding table and, when not tied, its LM head."""
  return [("embed_tokens", model.embed_tokens)] + ([] if model.lm_head is None else [("lm_head", model.lm_head)])


def embeddings_quantized(model) -> bool:
  return isinstance(model.embed_tokens, QuantizedKernel)


def is_quantized(model) -> bool:
  return any(isinstance(proj.kernel, QuantizedKernel) for _, proj in projections(model))


def as_variable(q: QuantizedTensor) -> QuantizedKernel:
  return QuantizedKernel(jax.tree.map(jnp.asarray, q))


def set_quantized(proj, q: QuantizedTensor) -> None:
  if tuple(q.shape) != tuple(proj.kernel.shape):
    raise ValueError(f"quantized kernel of shape {q.shape} for a kernel of shape {tuple(proj.kernel.shape)}")
  proj.kernel = as_variable(q)


def quantize_model(model, format: str, block: int = formats.DEFAULT_BLOCK, *, embeddings: bool = False):
  """Quantize every projection kernel of `model` IN PLACE (`formats.quantize`); returns `model`.

  `embeddings`: the embedding table and the LM head too, each stored (H, V) with blocks along
  the hidden size (`jaxsft.quant.kernel`)."""
  for path, proj in projections(model):
    try:
      q = formats.quantize(np.asarray(proj.kernel[...], np.float32), format, block)
    except ValueError as e:
      raise ValueError(f"model.quantize={format}: layers.{path}.kernel {tuple(proj.kernel.shape)}: {e}") from None
    set_quantized(proj, q)
  if embeddings:
    for name, table in tables(model):
      try:
        q = formats.quantize(np.asarray(table[...], np.float32).T, format, block)
      except ValueError as e:
        raise ValueError(f"model.quantize={format}: {name} {tuple(table.shape)}: {e}") from None
      setattr(model, name, as_variable(q))
  model.quantize = format
  return model


def dequantize_model(model):
  """Replace every quantized kernel with its dequantized float kernel (the model's dtype),
  IN PLACE: the base a quantized run trains on, as an ordinary model (export, merging)."""
  for _, proj in projections(model):
    if isinstance(proj.kernel, QuantizedKernel):
      proj.kernel = nnx.Param(kernel_value(proj.kernel, model.dtype))
  for name, table in tables(model):
    if isinstance(table, QuantizedKernel):
      setattr(model, name, nnx.Param(table_value(table, model.dtype)))
  model.quantize = "none"
  return model


def param_count(tree) -> int:
  """Weights in `tree`, a quantized kernel counted by its logical (L, in, out) size."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedTensor))
  return int(sum(int(np.prod(x.shape)) for x in leaves))


def tree_bytes(tree) -> int:
  """Bytes of every array in `tree` as stored (quantized codes and scales included)."""
  return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
