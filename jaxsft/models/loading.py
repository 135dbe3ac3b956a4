"""Load a `CausalLM` from a Hugging Face directory / hub id (safetensors) or a GGUF file.

No torch: `config.json` is read as JSON, weights with `safetensors.numpy`, GGUF with
`jaxsft.models.gguf` (the `gguf` package's numpy dequantization, llama.cpp's conventions undone
per architecture). Dequantized GGUF weights are cached as safetensors (float32, so the cache is
exact) under `ModelSource.cache_dir`, written to a temporary name and renamed, so a second load
skips dequantization and a crash never leaves a half-written cache behind.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import numpy as np

from jaxsft import io, quant
from jaxsft.config_checks import QUANTIZE_CHOICES
from jaxsft.errors import ConfigError, ModelError, ModelNotFoundError
from jaxsft.models import decoder, families, hf_weights, quantized
from jaxsft.models.gguf.read import read_gguf
from jaxsft.models.hub import ModelSource, hub_errors_named, load_tokenizer, resolve_model
from jaxsft.quant.formats import DEFAULT_BLOCK

_CACHE_FORMAT = "2"


def load_model(name_or_path: str, *, dtype: str = "float32", attention: str = "xla",
               remat: str | Callable | None = decoder.DEFAULT_REMAT, quantize: str = "none",
               quant_block_size: int = DEFAULT_BLOCK, quantize_embeddings: bool = False,
               chat_template: str | None = None):
  """`(model, tokenizer)` for a short name, HF directory, hub id or `.gguf` file.

  Args:
    name_or_path: e.g. "smollm2-135m-instruct", "/path/to/hf_dir", "org/name", "x.gguf".
    dtype: "float32" or "bfloat16" for the base weights and the compute.
    attention, remat: see `CausalLM`.
    quantize, quant_block_size: store the projection kernels block-quantized (`jaxsft.quant`):
      none, int8, nf4, int4 (blocks of `quant_block_size` inputs) or gguf (a GGUF file's own
      Q4_0 / Q4_1 / Q8_0 blocks).
    quantize_embeddings: the embedding table and LM head too (gguf: the file's own blocks of
      `token_embd` and `output`).
    chat_template: a template file or tokenizer folder whose chat template replaces the
      tokenizer's (`hub.read_chat_template`).
  """
  source = resolve_model(name_or_path)
  model = load_causal_lm(source, dtype=dtype, attention=attention, remat=remat, quantize=quantize,
                         quant_block_size=quant_block_size, quantize_embeddings=quantize_embeddings)
  return model, load_tokenizer(source, chat_template=chat_template)


def load_causal_lm(source: ModelSource | str, *, dtype: str = "float32", attention: str = "xla",
                   remat: str | Callable | None = decoder.DEFAULT_REMAT, quantize: str = "none",
                   quant_block_size: int = DEFAULT_BLOCK, quantize_embeddings: bool = False) -> decoder.CausalLM:
  """The model alone (no tokenizer): `load_model` without the tokenizer files."""
  # A training config's quantize settings were checked by `config.validate`; these guard the
  # library's own callers (chat, export, a script), and the last one needs the model's file.
  if quantize not in QUANTIZE_CHOICES:
    raise ConfigError(f"quantize must be one of {list(QUANTIZE_CHOICES)}, got {quantize!r}")
  if quantize_embeddings and quantize == "none":
    raise ConfigError("quantize_embeddings needs a quantize format (int8, nf4, int4 or gguf) to store them in")
  if isinstance(source, str):
    source = resolve_model(source)
  if quantize == "gguf" and source.gguf_file is None:
    raise ConfigError(f"model.quantize=gguf keeps a GGUF file's own blocks, but {source.name!r} is not a .gguf "
                      f"file (use int8, nf4 or int4)")
  if source.gguf_file is not None:
    hf_config, tensors, where = load_gguf_cached(source)
  else:
    folder = _local_folder(source)
    hf_config, tensors, where = _read_hf_folder(folder)
  config = families.from_hf_config(hf_config)
  model = hf_weights.from_hf_state_dict(config, tensors, dtype=dtype, source=where, attention=attention,
                                   remat=remat)
  model.name_or_path = source.name  # recorded as base_model_name_or_path in adapter configs
  if quantize == "gguf":
    quantized.load_gguf_blocks(model, pathlib.Path(source.path) / source.gguf_file, embeddings=quantize_embeddings)
  elif quantize != "none":
    quant.quantize_model(model, quantize, quant_block_size, embeddings=quantize_embeddings)
  return model


def _local_folder(source: ModelSource) -> pathlib.Path:
  if not source.is_hub_id:
    return pathlib.Path(source.path)
  from huggingface_hub import snapshot_download  # honours HF_HUB_OFFLINE

  with hub_errors_named(source):
    return pathlib.Path(snapshot_download(source.path, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                                        "*.txt"]))


def _read_hf_folder(folder: pathlib.Path) -> tuple[dict, dict[str, np.ndarray], str]:
  from safetensors.numpy import load_file

  hf_config = families.read_hf_config(folder)
  files = sorted(folder.glob("*.safetensors"))
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
  if not files:
    bins = sorted(p.name for p in folder.glob("*.bin"))
    raise ModelNotFoundError(f"{folder}: no *.safetensors weights" +
                            (f" (found {bins}: convert them to safetensors; jaxsft does not read "
                             f"PyTorch pickles)" if bins else ""))
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    tensors.update(_load_safetensors(f, load_file))
  return hf_config, tensors, str(folder)


def _load_safetensors(path: pathlib.Path, load_file) -> dict[str, np.ndarray]:
  try:
    try:
      return load_file(str(path))
    except TypeError:  # bfloat16 is not a numpy dtype: go through flax/jax
      from safetensors.flax import load_file as load_jax

      return {k: np.asarray(v.astype("float32")) for k, v in load_jax(str(path)).items()}
  except OSError:
    raise
  except Exception as e:  # safetensors' own SafetensorError (a bad header), or a length it cannot allocate
    raise ModelError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------------------------------------
# GGUF


def load_gguf_cached(source: ModelSource) -> tuple[dict, dict[str, np.ndarray], str]:
  """GGUF weights via the safetensors cache (created on first use)."""
  from safetensors.numpy import load_file, save_file

  gguf_path = pathlib.Path(source.path) / source.gguf_file
  stat = gguf_path.stat()
  stamp = f"{_CACHE_FORMAT}:{stat.st_size}:{int(stat.st_mtime)}"
  folder = source.cache_dir / "weights"
  weights, config_file = folder / "model.safetensors", folder / "config.json"
  if weights.is_file() and config_file.is_file():
    hf_config = json.loads(config_file.read_text())
    if hf_config.get("_jaxsft_gguf_stamp") == stamp:
      hf_config.pop("_jaxsft_gguf_stamp")
      return hf_config, load_file(str(weights)), f"{gguf_path} (cached in {folder})"
  hf_config, tensors = read_gguf(gguf_path)
  with io.atomic_path(weights) as tmp:
    save_file(tensors, str(tmp))
  io.write_json(config_file, {**hf_config, "_jaxsft_gguf_stamp": stamp})  # last: its stamp marks the cache complete
  return hf_config, tensors, str(gguf_path)
