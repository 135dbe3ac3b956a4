"""Load a `CausalLM` from a Hugging Face directory / hub id (safetensors) or a GGUF file.

No torch: `config.json` is read as JSON, weights with `safetensors.numpy`, GGUF with the `gguf`
package (numpy dequantization). transformers' own GGUF loader needs torch, so the GGUF tensor
names and llama.cpp's q/k permutation are mapped back here. Dequantized GGUF weights are
cached as safetensors (float32, so the cache is exact) under `ModelSource.cache_dir`, written
to a temporary name and renamed, so a second load skips dequantization and a crash never
leaves a half-written cache behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxsft import run_files
from jaxsft.models import llama
from jaxsft.models.hub import ModelSource, load_tokenizer, resolve_model

_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2"}
# GGUF tensor name (after `blk.{i}.`) -> Hugging Face name (after `model.layers.{i}.`).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_CACHE_FORMAT = "1"


def load_model(name_or_path: str, *, dtype: str = "float32", attention: str = "xla",
               remat: str | Callable | None = None):
  """`(model, tokenizer)` for a short name, HF directory, hub id or `.gguf` file.

  Args:
    name_or_path: e.g. "smollm2-135m-instruct", "/path/to/hf_dir", "org/name", "x.gguf".
    dtype: "float32" or "bfloat16" for the base weights and the compute.
    attention, remat: see `CausalLM`.
  """
  source = resolve_model(name_or_path)
  model = load_causal_lm(source, dtype=dtype, attention=attention, remat=remat)
  return model, load_tokenizer(source)


def load_causal_lm(source: ModelSource | str, *, dtype: str = "float32", attention: str = "xla",
                   remat: str | Callable | None = None) -> llama.CausalLM:
  """The model alone (no tokenizer): `load_model` without the tokenizer files."""
  if isinstance(source, str):
    source = resolve_model(source)
  if source.gguf_file is not None:
    hf_config, tensors, where = load_gguf_cached(source)
  else:
    folder = _local_folder(source)
    hf_config, tensors, where = _read_hf_folder(folder)
  config = llama.from_hf_config(hf_config)
  model = llama.from_hf_state_dict(config, tensors, dtype=dtype, source=where, attention=attention,
                                   remat=remat)
  model.name_or_path = source.name  # recorded as base_model_name_or_path in adapter configs
  return model


def _local_folder(source: ModelSource) -> pathlib.Path:
  if not source.is_hub_id:
    return pathlib.Path(source.path)
  from huggingface_hub import snapshot_download  # honours HF_HUB_OFFLINE

  return pathlib.Path(snapshot_download(source.path, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                                      "*.txt"]))


def _read_hf_folder(folder: pathlib.Path) -> tuple[dict, dict[str, np.ndarray], str]:
  from safetensors.numpy import load_file

  config_path = folder / "config.json"
  try:
    hf_config = json.loads(config_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_path}: line {e.lineno}: invalid JSON ({e.msg})") from None
  files = sorted(folder.glob("*.safetensors"))
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
  if not files:
    bins = sorted(p.name for p in folder.glob("*.bin"))
    raise FileNotFoundError(f"{folder}: no *.safetensors weights" +
                            (f" (found {bins}: convert them to safetensors; jaxsft does not read "
                             f"PyTorch pickles)" if bins else ""))
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    tensors.update(_load_safetensors(f, load_file))
  return hf_config, tensors, str(folder)


def _load_safetensors(path: pathlib.Path, load_file) -> dict[str, np.ndarray]:
  try:
    return load_file(str(path))
  except TypeError:  # bfloat16 is not a numpy dtype: go through flax/jax
    from safetensors.flax import load_file as load_jax

    return {k: np.asarray(v.astype("float32")) for k, v in load_jax(str(path)).items()}


# ---------------------------------------------------------------------------------------------
# GGUF


def _field(reader, key: str, default=None):
  field = reader.fields.get(key)
  if field is None:
    return default
  value = field.contents()
  return value


def gguf_config(reader, path: str) -> dict[str, Any]:
  """A transformers-style `config.json` dict from GGUF metadata."""
  arch = _field(reader, "general.architecture")
  if arch not in _GGUF_ARCHS:
    raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; jaxsft reads {sorted(_GGUF_ARCHS)}")
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names:
    raise ValueError(f"{path}: GGUF with rope_freqs.weight (Llama-3.1 rope scaling baked into a tensor) "
                     f"is not supported; load the Hugging Face directory instead")

  def need(key):
    value = _field(reader, f"{arch}.{key}")
    if value is None:
      raise ValueError(f"{path}: GGUF metadata field {arch}.{key} is missing")
    return value

  num_heads = int(need("attention.head_count"))
  hidden = int(need("embedding_length"))
  vocab = _field(reader, f"{arch}.vocab_size")
  if vocab is None:
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
  config = {
      "model_type": _GGUF_ARCHS[arch],
      "vocab_size": int(vocab), "hidden_size": hidden,
      "intermediate_size": int(need("feed_forward_length")),
      "num_hidden_layers": int(need("block_count")),
      "num_attention_heads": num_heads,
      "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
      "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
      # GGUF stores eps as float32 (9.9999997e-06): keep the shortest decimal that rounds to it
      "rms_norm_eps": float(str(np.float32(need("attention.layer_norm_rms_epsilon")))),
      "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
      "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
      "tie_word_embeddings": "output.weight" not in names,
      "attention_bias": "blk.0.attn_q.bias" in names and arch == "llama",
      "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
      "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
  }
  scaling = _field(reader, f"{arch}.rope.scaling.type")
  if scaling not in (None, "none"):
    raise ValueError(f"{path}: unsupported GGUF rope scaling {scaling!r}")
  return config


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's `permute` of q/k rows (interleaved RoPE pairs -> rotate-half halves).

  llama.cpp's convert script reshapes rows as (n_head, 2, d/2) and swaps the last two axes; the
  inverse reshapes as (n_head, d/2, 2) and swaps back.
  """
  rows = weight.shape[0]
  w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
  return w.swapaxes(1, 2).reshape(weight.shape)


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """`(hf_config, hf_named_float32_tensors)` from a GGUF file, dequantized with numpy."""
  from gguf import GGUFReader
  from gguf.quants import dequantize

  path = str(path)
  reader = GGUFReader(path)
  config = gguf_config(reader, path)
  permute = config["model_type"] == "llama"  # llama.cpp permutes q/k only for the llama arch
  tensors: dict[str, np.ndarray] = {}
  layer_re = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
  for t in reader.tensors:
    if t.name in _GGUF_GLOBAL_NAMES:
      name = _GGUF_GLOBAL_NAMES[t.name]
    else:
      m = layer_re.match(t.name)
      if m is None or m.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"{path}: unknown GGUF tensor {t.name!r} for {config['model_type']}")
      name = f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    value = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
    if permute and t.name.split(".")[-2] in ("attn_q", "attn_k"):
      heads = config["num_attention_heads"] if ".attn_q." in t.name else config["num_key_value_heads"]
      value = unpermute_qk(value, heads)
    tensors[name] = value
  return config, tensors


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
  with run_files.atomic_path(weights) as tmp:
    save_file(tensors, str(tmp))
  run_files.write_json(config_file, {**hf_config, "_jaxsft_gguf_stamp": stamp})  # last: its stamp marks the cache complete
  return hf_config, tensors, str(gguf_path)
