"""Reading a GGUF file: its metadata as a transformers-style config, read as llama.cpp reads it,
and its tensors dequantized (numpy) under Hugging Face names with llama.cpp's layout undone.

A file whose metadata llama.cpp builds would read differently, or that jaxsft cannot represent,
is refused naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NoReturn

import numpy as np

from jaxsft.errors import ModelError
from jaxsft.models.gguf.llama_cpp import (GEMMA3_LOCAL_ROPE_BASE, GEMMA3_SLIDING_PERIOD, GGUF_BIAS_ARCHS,
                                          GGUF_NORM_PLUS_ONE_ARCHS, GGUF_PERMUTED_QK_ARCHS,
                                          gemma3_query_pre_attn_scalar, gemma3_sliding_layers,
                                          smollm3_rope_layers, unpermute_qk)
from jaxsft.models.gguf.names import FULL, MODEL_TYPE_OF_GGUF_ARCH, SLIDING, hf_tensor_name


def open_gguf(path: str | os.PathLike):
  """A `gguf.GGUFReader` of `path`; a header it cannot parse (a count or length no file holds,
  a cut file) is a `ModelError` naming the file."""
  from gguf import GGUFReader

  try:
    return GGUFReader(str(path))
  except OSError:
    raise
  except Exception as e:  # the reader's IndexError, ValueError or MemoryError on a hostile header
    raise ModelError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def gguf_field(reader, key: str, default=None):
  """The value of metadata `key` of a `gguf.GGUFReader` (arrays as lists), or `default`."""
  field = reader.fields.get(key)
  if field is None:
    return default
  value = field.contents()
  return value


def _f32(value) -> float:
  """A float32 GGUF value as the shortest decimal that rounds to it (9.9999997e-06 -> 1e-05)."""
  return float(str(np.float32(value)))


@dataclasses.dataclass(frozen=True)
class _GgufMetadata:
  """The `{arch}.*` keys of one GGUF file; every error names the file and the key."""

  reader: Any
  arch: str
  path: str

  def get(self, key: str, default=None):
    return gguf_field(self.reader, f"{self.arch}.{key}", default)

  def need(self, key: str):
    value = self.get(key)
    if value is None:
      raise ModelError(f"{self.path}: GGUF metadata field {self.arch}.{key} is missing")
    return value

  def refuse(self, key: str, why: str) -> NoReturn:
    raise ModelError(f"{self.path}: {self.arch}.{key} = {self.get(key)!r}: {why}")


def gguf_config(reader, path: str) -> dict[str, Any]:
  """A transformers-style `config.json` dict from GGUF metadata, read as llama.cpp reads it.

  Raises `ModelError` (a `ValueError`) naming the file and the key for an architecture jaxsft does
  not read, and for metadata llama.cpp would run differently from any jaxsft model (softcapping, LongRoPE and
  YaRN, bias tensors on the archs llama.cpp builds without them, OLMo 3's sliding windows, a Gemma
  3 pattern or local RoPE base that llama.cpp's builds disagree on).
  """
  arch = gguf_field(reader, "general.architecture")
  if arch not in MODEL_TYPE_OF_GGUF_ARCH:
    raise ModelError(f"{path}: unsupported GGUF architecture {arch!r}; jaxsft reads "
                     f"{sorted(MODEL_TYPE_OF_GGUF_ARCH)}")
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names:
    raise ModelError(f"{path}: GGUF with rope_freqs.weight (Llama-3.1 rope scaling baked into a tensor) "
                     f"is not supported; load the Hugging Face directory instead")
  if names & {"rope_factors_long.weight", "rope_factors_short.weight"}:
    raise ModelError(f"{path}: GGUF with rope_factors_long/short (Phi-3 LongRoPE) is not supported; jaxsft "
                     f"has no LongRoPE")
  meta = _GgufMetadata(reader, arch, path)
  config = _gguf_model_fields(meta, names)
  full_rope, rotary = _gguf_rope(meta, config["head_dim"])
  window = meta.get("attention.sliding_window")
  window = int(window) if window else None  # 0: none
  if config["model_type"] == "gemma3_text":
    config.update(_gemma3_fields(meta, config, full_rope, window))
    return config
  config.update(rope_parameters=full_rope, rope_theta=full_rope["rope_theta"])
  if config["model_type"] == "phi3":
    head_dim = config["head_dim"]
    partial = rotary / head_dim
    if not 0 < rotary <= head_dim or int(head_dim * partial) != rotary:
      meta.refuse("rope.dimension_count", f"not a partial rotary factor of head_dim {head_dim}")
    full_rope["partial_rotary_factor"] = partial
    config["sliding_window"] = window  # llama.cpp currently runs Phi-3 without it, with a warning
  elif config["model_type"] == "olmo2" and window is not None:
    meta.refuse("attention.sliding_window", "an olmo2 file with a sliding window is OLMo 3 (every 4th "
                                            "layer full), which jaxsft does not build")
  elif config["model_type"] == "smollm3":
    config["no_rope_layers"] = [int(r) for r in smollm3_rope_layers(config["num_hidden_layers"])]
  return config


def _gguf_model_fields(meta: _GgufMetadata, names: set[str]) -> dict[str, Any]:
  """The sizes, norm epsilon, tying and special token ids every family has."""
  arch, path = meta.arch, meta.path
  num_heads = int(meta.need("attention.head_count"))
  hidden = int(meta.need("embedding_length"))
  num_layers = int(meta.need("block_count"))
  head_dim = int(meta.get("attention.key_length", hidden // num_heads))
  if int(meta.get("attention.value_length", head_dim)) != head_dim:
    meta.refuse("attention.value_length", f"jaxsft needs value heads as wide as key heads ({head_dim})")
  vocab = meta.get("vocab_size")
  if vocab is None:
    tokens = meta.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
      raise ModelError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens: the vocabulary size is unknown")
    vocab = len(tokens.data)
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    if meta.get(key) not in (None, 0.0):
      meta.refuse(key, "jaxsft has no logit softcapping")
  model_type = MODEL_TYPE_OF_GGUF_ARCH[arch]
  if arch not in GGUF_BIAS_ARCHS and any(n.endswith(".bias") for n in names):
    raise ModelError(f"{path}: GGUF {arch} with bias tensors is not supported (jaxsft's {model_type} has none)")
  return {
      "model_type": model_type,
      "vocab_size": int(vocab), "hidden_size": hidden,
      "intermediate_size": int(meta.need("feed_forward_length")),
      "num_hidden_layers": num_layers,
      "num_attention_heads": num_heads,
      "num_key_value_heads": int(meta.get("attention.head_count_kv", num_heads)),
      "head_dim": head_dim,
      # GGUF stores floats as float32 (9.9999997e-06): keep the shortest decimal that rounds to it
      "rms_norm_eps": _f32(meta.need("attention.layer_norm_rms_epsilon")),
      "max_position_embeddings": int(meta.get("context_length", 2048)),
      "tie_word_embeddings": "output.weight" not in names,
      "attention_bias": "blk.0.attn_q.bias" in names and arch == "llama",
      "bos_token_id": gguf_field(meta.reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": gguf_field(meta.reader, "tokenizer.ggml.eos_token_id"),
      "pad_token_id": gguf_field(meta.reader, "tokenizer.ggml.padding_token_id"),
  }


def _gguf_rope(meta: _GgufMetadata, head_dim: int) -> tuple[dict[str, Any], int]:
  """(HF rope parameters of the full-attention layers, rotary dimensions per head).

  llama.cpp reads the base and a linear factor (rope.scaling.factor, or the older
  rope.scale_linear) for every architecture; the factor divides the frequencies like HF "linear".
  """
  full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(meta.get("rope.freq_base", 10000.0))}
  if meta.get("rope.scaling.type") not in (None, "none", "linear"):
    meta.refuse("rope.scaling.type", "jaxsft reads linear RoPE scaling only")
  factor = meta.get("rope.scaling.factor", meta.get("rope.scale_linear"))
  if factor not in (None, 0.0, 1.0):
    full_rope.update(rope_type="linear", factor=_f32(factor))
  rotary = int(meta.get("rope.dimension_count", head_dim))
  if meta.arch != "phi3" and rotary != head_dim:
    meta.refuse("rope.dimension_count", f"partial rotary (head_dim {head_dim}) is Phi-3's only")
  return full_rope, rotary


def _gemma3_fields(meta: _GgufMetadata, config: dict[str, Any], full_rope: dict[str, Any],
                   window: int | None) -> dict[str, Any]:
  """Gemma 3's activation, sliding layers and their RoPE base and attention scale, as llama.cpp
  fixes them; a file whose keys say otherwise is refused (llama.cpp's builds disagree on it)."""
  if window is None:  # llama.cpp requires the key; a build without it has no sliding layers at all
    meta.refuse("attention.sliding_window", "llama.cpp builds disagree on a Gemma 3 file without a window")
  num_layers = config["num_hidden_layers"]
  sliding = gemma3_sliding_layers(num_layers)
  pattern = meta.get("attention.sliding_window_pattern")
  if pattern is not None:
    given = gemma3_sliding_layers(num_layers, int(pattern)) if np.ndim(pattern) == 0 else tuple(map(bool, pattern))
    if given != sliding:
      meta.refuse("attention.sliding_window_pattern", f"llama.cpp's gemma3 fixes the pattern at period "
                                                      f"{GEMMA3_SLIDING_PERIOD}; builds that read this key disagree")
  local_theta = _f32(meta.get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
  if local_theta != GEMMA3_LOCAL_ROPE_BASE:
    meta.refuse("rope.freq_base_swa", f"llama.cpp's gemma3 fixes the sliding layers' RoPE base at "
                                      f"{GEMMA3_LOCAL_ROPE_BASE:g}; builds that read this key disagree")
  return dict(
      hidden_activation="gelu_pytorch_tanh", sliding_window=window,
      layer_types=[SLIDING if s else FULL for s in sliding],
      query_pre_attn_scalar=gemma3_query_pre_attn_scalar(num_layers, config["hidden_size"],
                                                         config["num_attention_heads"], config["head_dim"]),
      rope_parameters={FULL: full_rope, SLIDING: {"rope_type": "default", "rope_theta": local_theta}})


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """`(hf_config, hf_named_float32_tensors)` from a GGUF file, dequantized with numpy, with
  llama.cpp's q/k permutation and Gemma's 1 + w norms undone."""
  from gguf.quants import dequantize

  path = str(path)
  reader = open_gguf(path)
  config = gguf_config(reader, path)
  arch = gguf_field(reader, "general.architecture")
  tensors: dict[str, np.ndarray] = {}
  for t in reader.tensors:
    name = hf_tensor_name(t.name, arch, path)
    try:
      value = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
    except (ValueError, NotImplementedError, TypeError) as e:  # a type or size the header misstates
      raise ModelError(f"{path}: tensor {t.name!r} cannot be read ({type(e).__name__}: {e})") from None
    if arch in GGUF_PERMUTED_QK_ARCHS and t.name.split(".")[-2] in ("attn_q", "attn_k"):
      heads = config["num_attention_heads"] if ".attn_q." in t.name else config["num_key_value_heads"]
      value = unpermute_qk(value, heads)
    if arch in GGUF_NORM_PLUS_ONE_ARCHS and t.name.endswith("norm.weight"):
      value = value - np.float32(1)
    tensors[name] = value
  return config, tensors
