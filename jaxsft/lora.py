"""LoRA adapters on the stacked decoder, in Hugging Face PEFT's file format.

For a projection y = x W (W: (in, out)), LoRA adds

  y = x W + s · dropout(x) A B,   A: (in, r), B: (r, out),   s = alpha / r  (rsLoRA: alpha / √r)

initialized like PEFT (`nn.init.kaiming_uniform_(A, a=√5)`, i.e. A ~ U(-1/√in, 1/√in), and
B = 0), so the adapted model starts equal to the base. A and B are `nnx.LoRAParam` (float32
even on a bfloat16 base): the trainable state is `nnx.DiffState(0, nnx.LoRAParam)`, and the
frozen base is `nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))` (LoRAParam subclasses Param).

Why not `nnx.LoRA`: it has no scale and no input dropout (both part of PEFT's math, and the
scale must stay out of the saved B), and the decoder's weights are stacked over layers
(L, in, out) for `lax.scan`. So the projections carry `nnx.LoRAParam` factors stacked the same
way, (L, in, r) and (L, r, out), and apply them with a two-matmul expression
(`jaxsft.models.linear.Linear`).

PEFT stores per layer `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` of
shape (r, in) and `...lora_B.weight` of shape (out, r): the transposes of layer i's A and B.

DoRA (`use_dora`, peft's `LoraConfig(use_dora=True)`) adds a trained magnitude m per output of
every targeted projection, initialized to the adapted weight's column norms ‖W + s·A B‖ (= ‖W‖,
B being 0), so the model again starts equal to the base; `Linear` holds the forward math. PEFT
stores it per layer as `...q_proj.lora_magnitude_vector` of shape (out,). Merged, the kernel is

  W' = (W + s·A B) · diag(m / ‖W + s·A B‖).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import warnings
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsft import io
from jaxsft.errors import JaxsftError, ModelNotFoundError
from jaxsft.models.linear import Linear, dora_weight_norm
from jaxsft.quant.formats import DEFAULT_BLOCK
from jaxsft.quant.kernel import kernel_value

# The Llama family's projections: module name -> path inside a decoder layer (as in transformers).
# Other families have their own set (Phi-3 fuses q/k/v into qkv_proj and gate/up into
# gate_up_proj): `module_paths(model)` reads it off the model.
MODULE_PATHS = {
    "q_proj": ("self_attn", "q_proj"), "k_proj": ("self_attn", "k_proj"),
    "v_proj": ("self_attn", "v_proj"), "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_proj"), "up_proj": ("mlp", "up_proj"), "down_proj": ("mlp", "down_proj"),
}
ALL_LINEAR = tuple(MODULE_PATHS)  # PEFT's "all-linear": every linear layer but the LM head
_CANONICAL_ORDER = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                    "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterError(JaxsftError, ValueError):
  """A PEFT adapter jaxsft cannot load as it is (the message names the file and the field)."""


_PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                       r"(?:lora_([AB])\.weight|lora_(magnitude)_vector)$")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  r: int
  alpha: float
  dropout: float
  target_modules: tuple[str, ...]
  rslora: bool
  use_dora: bool = False

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def module_paths(model) -> dict[str, tuple[str, str]]:
  """The model's projections, name -> path inside a decoder layer (("self_attn", "q_proj"),
  ...), attention first: the modules `target_modules` may name."""
  found = {str(path[1]): (str(path[0]), str(path[1])) for path, module in nnx.iter_graph(model.layers)
           if isinstance(module, Linear) and len(path) == 2}
  order = [n for n in _CANONICAL_ORDER if n in found] + sorted(set(found) - set(_CANONICAL_ORDER))
  return {n: found[n] for n in order}


def resolve_target_modules(target_modules: str | Iterable[str],
                           available: Sequence[str] = ALL_LINEAR) -> tuple[str, ...]:
  """Module names in the order of `available` (a model's `module_paths`); "all-linear" means
  every one of them."""
  available = tuple(available)
  if isinstance(target_modules, str):
    target_modules = available if target_modules == "all-linear" else (target_modules,)
  names = tuple(target_modules)
  if "all-linear" in names:
    return available
  unknown = [n for n in names if n not in available]
  if unknown or not names:
    raise ValueError(f"unknown LoRA target module(s) {unknown or names} for this model: choose from "
                     f"{list(available)} or 'all-linear'")
  return tuple(n for n in available if n in names)


def _projection(model, name: str):
  module = model.layers
  for attr in module_paths(model)[name]:
    module = getattr(module, attr)
  return module


def lora_settings(model) -> LoraSettings | None:
  return getattr(model, "lora_settings", None)


def apply_lora(model, *, r: int = 8, alpha: float = 16, dropout: float = 0.0,
               target_modules: str | Sequence[str] = ("q_proj", "v_proj"), rslora: bool = False,
               use_dora: bool = False, seed: int = 0):
  """Add LoRA factors to `model`'s projections IN PLACE and return the same model.

  A ~ U(-1/√in, 1/√in) (PEFT's kaiming-uniform with a=√5), B = 0, both float32 `nnx.LoRAParam`;
  with `use_dora` also DoRA's magnitude m = ‖W‖ over the input axis (float32 `nnx.LoRAParam`).
  Re-applying replaces existing adapters.
  """
  if r <= 0:
    raise ValueError(f"LoRA rank r must be positive, got {r}")
  if not 0.0 <= dropout < 1.0:
    raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
  names = resolve_target_modules(target_modules, tuple(module_paths(model)))
  remove_lora(model)
  key = jax.random.key(seed)
  for index, name in enumerate(names):
    proj = _projection(model, name)
    layers, fan_in, fan_out = proj.kernel.shape
    bound = 1.0 / math.sqrt(fan_in)
    proj.lora_a = nnx.LoRAParam(jax.random.uniform(jax.random.fold_in(key, index), (layers, fan_in, r),
                                                   jnp.float32, -bound, bound))
    proj.lora_b = nnx.LoRAParam(jnp.zeros((layers, r, fan_out), jnp.float32))
  settings = LoraSettings(r=r, alpha=float(alpha), dropout=float(dropout), target_modules=names,
                          rslora=bool(rslora), use_dora=bool(use_dora))
  if use_dora:
    for name in names:
      proj = _projection(model, name)
      proj.lora_magnitude = nnx.LoRAParam(_weight_norm(proj, settings.scale))
  _set_scales(model, settings)
  return model


def _weight_norm(proj, scale: float) -> jax.Array:
  """‖W + s·A B‖ over the input axis of every layer of `proj`: (L, out) float32 (the base
  dequantized first when quantized, as peft's `dequantize_module_weight`)."""
  return dora_weight_norm(kernel_value(proj.kernel, jnp.float32), proj.lora_a[...], proj.lora_b[...], scale)


def _set_scales(model, settings: LoraSettings):
  for name in settings.target_modules:
    proj = _projection(model, name)
    proj.lora_scale = settings.scale
    proj.lora_dropout = settings.dropout
  model.lora_settings = settings


def remove_lora(model):
  """Drop every LoRA factor (without merging)."""
  for name in module_paths(model):
    proj = _projection(model, name)
    proj.lora_a = proj.lora_b = proj.lora_magnitude = None
    proj.lora_scale, proj.lora_dropout = 0.0, 0.0
  model.lora_settings = None
  return model


def base_of(model):
  """The same graph computing the base model's outputs, sharing its weights, for the tuned-vs-base
  comparison: every LoRA param zeroed, except DoRA's magnitude m, which becomes ‖W‖ (over the input
  axis) so that its column scale m / ‖W + s·A B‖ is 1 with B = 0. Zeroed, m would scale every
  targeted projection's output to 0."""
  graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
  base = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, lora), rest)
  for name in module_paths(base):
    proj = _projection(base, name)
    if proj.lora_magnitude is not None:
      proj.lora_magnitude = nnx.LoRAParam(_weight_norm(proj, proj.lora_scale))
  return base


def merge_lora(model):
  """Fold s · A B into the base kernels (in the base dtype) and remove the adapters, in place;
  DoRA: W' = (W + s·A B) · diag(m / ‖W + s·A B‖), the norm over the input axis (peft's merge)."""
  settings = lora_settings(model)
  if settings is None:
    raise ValueError("merge_lora: the model has no LoRA adapters")
  for name in settings.target_modules:
    proj = _projection(model, name)
    kernel = proj.kernel[...]
    delta = jnp.einsum("lir,lro->lio", proj.lora_a[...], proj.lora_b[...],
                       precision=jax.lax.Precision.HIGHEST) * settings.scale
    merged = kernel.astype(jnp.float32) + delta
    if proj.lora_magnitude is not None:
      merged = merged * (proj.lora_magnitude[...] / jnp.linalg.norm(merged, axis=-2))[:, None, :]
    proj.kernel.set_value(merged.astype(kernel.dtype))
  return remove_lora(model)


# ---------------------------------------------------------------------------------------------
# PEFT files


def peft_adapter_config(settings: LoraSettings, base_model_name_or_path: str | None) -> dict:
  """`adapter_config.json` as peft 0.21 writes it for a LoRA on a causal LM."""
  return {
      "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base_model_name_or_path,
      "bias": "none", "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
      "init_lora_weights": True, "layer_replication": None, "layers_pattern": None,
      "layers_to_transform": None, "loftq_config": {}, "lora_alpha": settings.alpha,
      "lora_bias": False, "lora_dropout": settings.dropout, "megatron_config": None,
      "megatron_core": "megatron.core", "modules_to_save": None, "peft_type": "LORA",
      "r": settings.r, "rank_pattern": {}, "revision": None,
      "target_modules": sorted(settings.target_modules), "target_parameters": None,
      "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_dora": settings.use_dora,
      "use_qalora": False, "use_rslora": settings.rslora,
  }


def adapter_tensors(model) -> dict[str, np.ndarray]:
  """PEFT-named float32 tensors: per layer lora_A (r, in) and lora_B (out, r) (DoRA: and
  lora_magnitude_vector (out,))."""
  settings = lora_settings(model)
  if settings is None:
    raise ValueError("the model has no LoRA adapters (call apply_lora or load_adapter first)")
  out = {}
  paths = module_paths(model)
  for name in settings.target_modules:
    proj = _projection(model, name)
    a = np.asarray(proj.lora_a[...], np.float32)
    b = np.asarray(proj.lora_b[...], np.float32)
    prefix = ".".join(paths[name])
    for i in range(a.shape[0]):
      key = f"base_model.model.model.layers.{i}.{prefix}"
      out[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
      out[f"{key}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
      if proj.lora_magnitude is not None:
        out[f"{key}.lora_magnitude_vector"] = np.ascontiguousarray(np.asarray(proj.lora_magnitude[...][i], np.float32))
  return out


def save_adapter(model, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None):
  """Write `adapter_config.json` + `adapter_model.safetensors` (PEFT format), each atomically."""
  from safetensors.numpy import save_file

  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tensors = adapter_tensors(model)
  if base_model_name_or_path is None:
    base_model_name_or_path = getattr(model, "name_or_path", None)
  config = peft_adapter_config(lora_settings(model), base_model_name_or_path)
  with io.atomic_path(directory / ADAPTER_WEIGHTS) as tmp:
    save_file(tensors, str(tmp), metadata={"format": "pt"})
  io.write_json(directory / ADAPTER_CONFIG, config)
  return directory


def _read_adapter_config(path: pathlib.Path) -> dict:
  try:
    config = json.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise FileNotFoundError(f"{path}: no adapter_config.json (not a PEFT adapter directory)") from None
  except json.JSONDecodeError as e:
    raise AdapterError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None
  except UnicodeDecodeError as e:
    raise AdapterError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None
  except RecursionError:
    raise AdapterError(f"{path}: JSON nested too deeply to be an adapter config") from None
  if not isinstance(config, dict):
    raise AdapterError(f"{path}: expected a JSON object, got {type(config).__name__}")
  if config.get("peft_type") != "LORA":
    raise AdapterError(f"{path}: field peft_type is {config.get('peft_type')!r}; only LORA adapters load")
  unsupported = {
      "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
      "layers_to_transform": None, "layer_replication": None, "lora_bias": False,
      "trainable_token_indices": None, "target_parameters": None,
  }
  for field, ok in unsupported.items():
    if config.get(field, ok) not in (ok, [], {}):
      raise AdapterError(f"{path}: field {field}={config[field]!r} is not supported (expected {ok!r})")
  for field in ("rank_pattern", "alpha_pattern"):
    if config.get(field):
      raise AdapterError(f"{path}: field {field}={config[field]!r} is not supported (per-module r/alpha)")
  for field in ("r", "lora_alpha"):
    if not isinstance(config.get(field), (int, float)) or isinstance(config.get(field), bool):
      raise AdapterError(f"{path}: field {field} is missing or not a number: {config.get(field)!r}")
  # The ranges training accepts (jaxsft.config_checks.RANGES): a rank is a whole number >= 1, the
  # scale alpha a finite positive number, the dropout a probability below 1.
  r, alpha, dropout = config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0)
  if not (isinstance(r, int) or float(r).is_integer()) or not math.isfinite(r) or r < 1:
    raise AdapterError(f"{path}: field r must be a whole number >= 1, got {r!r}")
  if not math.isfinite(alpha) or alpha <= 0:
    raise AdapterError(f"{path}: field lora_alpha must be a finite number > 0, got {alpha!r}")
  if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
    raise AdapterError(f"{path}: field lora_dropout must be in [0, 1), got {dropout!r}")
  for field in ("use_rslora", "use_dora"):
    if not isinstance(config.get(field, False), bool):
      raise AdapterError(f"{path}: field {field} must be true or false, got {config[field]!r}")
  return config


def load_adapter(model, directory: str | os.PathLike):
  """Load a PEFT LoRA adapter (from jaxsft or from peft in PyTorch) onto `model`, in place.

  Any tensor that does not fit (unknown module or key, wrong shape, layer out of range, a
  missing A/B or layer) raises an error naming the tensor; nothing is skipped silently.
  """
  directory = pathlib.Path(directory)
  config = _read_adapter_config(directory / ADAPTER_CONFIG)
  weights_path = directory / ADAPTER_WEIGHTS
  tensors = _read_adapter_weights(weights_path)
  r = int(config["r"])
  num_layers = model.config.num_layers
  paths = module_paths(model)
  use_dora = bool(config.get("use_dora", False))
  found = _adapter_tensors_by_module(model, tensors, r, weights_path, use_dora)
  declared = config.get("target_modules")
  if isinstance(declared, (list, tuple)) and set(found) - set(declared):
    raise ValueError(f"{directory / ADAPTER_CONFIG}: target_modules {declared} does not list "
                     f"{sorted(set(found) - set(declared))}, which have tensors")
  base = config.get("base_model_name_or_path")
  own = getattr(model, "name_or_path", None)
  if base and own and base != own:
    warnings.warn(f"{directory}: adapter was made for base {base!r}, loading onto {own!r} (shapes match)")

  names = tuple(n for n in paths if n in found)
  remove_lora(model)
  for name in names:
    proj = _projection(model, name)
    layers = found[name]
    proj.lora_a = nnx.LoRAParam(jnp.asarray(np.stack([layers[i]["A"].T for i in range(num_layers)]),
                                            jnp.float32))
    proj.lora_b = nnx.LoRAParam(jnp.asarray(np.stack([layers[i]["B"].T for i in range(num_layers)]),
                                            jnp.float32))
    if use_dora:
      proj.lora_magnitude = nnx.LoRAParam(jnp.asarray(np.stack([layers[i]["magnitude"] for i in range(num_layers)]),
                                                      jnp.float32))
  settings = LoraSettings(r=r, alpha=float(config["lora_alpha"]), dropout=float(config.get("lora_dropout", 0.0)),
                          target_modules=names, rslora=bool(config.get("use_rslora", False)), use_dora=use_dora)
  _set_scales(model, settings)
  return model


def _read_adapter_weights(weights_path: pathlib.Path) -> dict[str, np.ndarray]:
  """The tensors of an adapter's safetensors file; a missing or unreadable one is refused."""
  from safetensors.numpy import load_file

  if not weights_path.is_file():
    raise FileNotFoundError(f"{weights_path}: missing (PEFT adapters are read from safetensors)")
  try:
    return load_file(str(weights_path))
  except Exception as e:  # safetensors' own SafetensorError (a bad header), or a length it cannot allocate
    raise AdapterError(f"{weights_path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _adapter_tensors_by_module(model, tensors: dict[str, np.ndarray], r: int, weights_path: pathlib.Path,
                               use_dora: bool = False) -> dict[str, dict[int, dict[str, np.ndarray]]]:
  """module -> layer -> "A"/"B" ("magnitude" with `use_dora`) -> the PEFT tensor, each checked
  against `model` (its module, layer and shape) and every targeted module complete in every
  layer; ValueError naming the tensor otherwise."""
  num_layers = model.config.num_layers
  paths = module_paths(model)
  found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
  for key, value in tensors.items():
    m = _PEFT_KEY.match(key)
    if m is None:
      raise ValueError(f"{weights_path}: tensor {key!r} is not a LoRA A/B weight of a decoder projection")
    layer, group, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4) or m.group(5)
    if which == "magnitude" and not use_dora:
      raise ValueError(f"{weights_path}: tensor {key!r} is a DoRA magnitude, but adapter_config.json has no "
                       f"use_dora: true")
    if module not in paths or paths[module][0] != group:
      raise ValueError(f"{weights_path}: tensor {key!r} targets module {group}.{module}, which "
                       f"{model.config.architecture} does not have (its modules: {list(paths)})")
    if layer >= num_layers:
      raise ValueError(f"{weights_path}: tensor {key!r} is for layer {layer}, the model has {num_layers}")
    _, fan_in, fan_out = _projection(model, module).kernel.shape
    expected = {"A": (r, fan_in), "B": (fan_out, r), "magnitude": (fan_out,)}[which]
    if value.shape != expected:
      raise ValueError(f"{weights_path}: tensor {key!r} has shape {value.shape}, expected {expected} "
                       f"(r={r}; adapter made for another base model?)")
    found.setdefault(module, {}).setdefault(layer, {})[which] = value
  if not found:
    raise ValueError(f"{weights_path}: no LoRA tensors")
  for module, layers in found.items():
    for layer in range(num_layers):
      for which in ("A", "B", "magnitude") if use_dora else ("A", "B"):
        if which not in layers.get(layer, {}):
          name = "lora_magnitude_vector" if which == "magnitude" else f"lora_{which}.weight"
          raise ValueError(f"{weights_path}: tensor base_model.model.model.layers.{layer}."
                           f"{'.'.join(paths[module])}.{name} is missing")
  return found


def load_with_adapter(model_name: str, adapter: str | os.PathLike | None, *, dtype: str, quantize: str = "none",
                      quant_block_size: int = DEFAULT_BLOCK, quantize_embeddings: bool = False,
                      chat_template: str | None = None):
  """(model, tokenizer) of `model_name` (its base stored as `quantize` says, see `jaxsft.quant`;
  its tokenizer with the chat template at `chat_template`, when given) with the PEFT adapter in
  `adapter` (None: no adapter) loaded onto it. A missing model, a folder
  that is not an adapter, or an adapter for another base raise ValueError with one line that
  says which."""
  from jaxsft import models  # models' loading imports this module

  if adapter is not None and not (pathlib.Path(adapter) / ADAPTER_CONFIG).is_file():
    raise ValueError(f"{pathlib.Path(adapter) / ADAPTER_CONFIG} is missing: not a PEFT adapter directory")
  try:
    model, tokenizer = models.load_model(model_name, dtype=dtype, quantize=quantize, quant_block_size=quant_block_size,
                                         quantize_embeddings=quantize_embeddings, chat_template=chat_template)
  except ModelNotFoundError:
    raise  # it names the model already
  except (FileNotFoundError, ValueError, KeyError) as e:
    raise ValueError(f"cannot load model {model_name!r}: {e}") from None
  if adapter is not None:
    try:
      load_adapter(model, adapter)
    except (FileNotFoundError, ValueError) as e:
      raise ValueError(f"adapter {adapter} does not fit model {model_name!r}: {e}") from None
  return model, tokenizer
