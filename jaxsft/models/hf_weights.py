"""Hugging Face weights <-> a `CausalLM`: tensor names (`model.layers.{i}.self_attn.q_proj.weight`,
...) and layouts (PyTorch's (out, in) `weight` against the (in, out) `kernel`, one tensor per
layer against the stacked layer axis). The configuration's mapping is `jaxsft.models.families`'.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsft.models.decoder import CausalLM, resolve_dtype
from jaxsft.models.families import LlamaConfig


def from_hf_state_dict(config: LlamaConfig, tensors: Mapping[str, np.ndarray], *, dtype="float32",
                       source: str = "state dict", **kwargs) -> CausalLM:
  """Build a `CausalLM` from Hugging Face named weights (`model.layers.0.self_attn.q_proj.weight`, ...).

  Every expected tensor must be present with the HF shape and every given tensor must be used
  (rotary buffers excepted): a mismatch is an error naming the tensor and `source`.
  """
  dtype = resolve_dtype(dtype)
  model = nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0), **kwargs))
  used: set[str] = set()

  def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise KeyError(f"{source}: missing tensor {name!r} (expected shape {shape}) for {config.architecture}")
    value = np.asarray(tensors[name])
    if value.shape != shape:
      raise ValueError(f"{source}: tensor {name!r} has shape {value.shape}, expected {shape} "
                       f"for {config.architecture} (another model?)")
    used.add(name)
    return value

  def assign(variable: nnx.Variable, value: np.ndarray):
    variable.set_value(jnp.asarray(value, dtype))

  h, v = config.hidden_size, config.vocab_size
  assign(model.embed_tokens, take("model.embed_tokens.weight", (v, h)))
  assign(model.norm.weight, take("model.norm.weight", (h,)))
  if model.lm_head is not None:
    assign(model.lm_head, take("lm_head.weight", (v, h)))
  elif "lm_head.weight" in tensors:
    used.add("lm_head.weight")  # tied: a saved copy of the embedding is redundant

  for path, variable in nnx.iter_graph(model.layers):
    if not isinstance(variable, nnx.Param) or isinstance(variable, nnx.LoRAParam):
      continue
    module_path = ".".join(str(p) for p in path[:-1])
    leaf = path[-1]
    per_layer_shape = tuple(variable.shape[1:])
    if leaf == "kernel":  # (in, out) here, (out, in) in PyTorch
      # Stacked as stored, transposed by XLA on the device: numpy's strided copy of every
      # transposed kernel is the slow part of loading a large model.
      hf_shape = per_layer_shape[::-1]
      stacked = np.stack([take(f"model.layers.{i}.{module_path}.weight", hf_shape) for i in range(config.num_layers)])
      variable.set_value(jnp.swapaxes(jnp.asarray(stacked, dtype), 1, 2))
    else:  # bias, norm weight
      assign(variable, np.stack([take(f"model.layers.{i}.{module_path}.{leaf}", per_layer_shape)
                                 for i in range(config.num_layers)]))

  unused = sorted(k for k in tensors if k not in used and not k.endswith("rotary_emb.inv_freq"))
  if unused:
    raise ValueError(f"{source}: tensors not used by {config.architecture}: {unused[:8]}"
                     f"{' ...' if len(unused) > 8 else ''}")
  return model


def to_hf_state_dict(model: CausalLM) -> dict[str, np.ndarray]:
  """The inverse of `from_hf_state_dict` (base weights only; merge LoRA first to export it)."""
  config = model.config
  out = {"model.embed_tokens.weight": np.asarray(model.embed_tokens[...]),
         "model.norm.weight": np.asarray(model.norm.weight[...])}
  if model.lm_head is not None:
    out["lm_head.weight"] = np.asarray(model.lm_head[...])
  for path, variable in nnx.iter_graph(model.layers):
    if not isinstance(variable, nnx.Param) or isinstance(variable, nnx.LoRAParam):
      continue
    module_path = ".".join(str(p) for p in path[:-1])
    leaf = path[-1]
    if leaf == "kernel":  # transposed by XLA where the weights are, then copied out (writable, as numpy's own)
      stacked = np.array(jnp.swapaxes(variable[...], 1, 2))
      for i in range(config.num_layers):
        out[f"model.layers.{i}.{module_path}.weight"] = stacked[i]
    else:
      stacked = np.asarray(variable[...])
      for i in range(config.num_layers):
        out[f"model.layers.{i}.{module_path}.{leaf}"] = stacked[i]
  return out
