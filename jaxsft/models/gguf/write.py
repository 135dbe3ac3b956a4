"""Writing a model as one GGUF file, as llama.cpp's `convert_hf_to_gguf.py` writes its family,
and `gguf_refusal`: why a model has no GGUF file llama.cpp runs as jaxsft does.

The file holds the architecture metadata, the tokenizer fields (`jaxsft.models.gguf.tokenizer`)
and the tensors in llama.cpp's names and layout (q/k rows permuted for llama and smollm3, Gemma 3
norms as 1 + w, Phi-3's fused attn_qkv and gate_up in ffn_up); `q8_0` quantizes the matrices,
norms stay float32.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from jaxsft.models.gguf.llama_cpp import (GEMMA3_LOCAL_ROPE_BASE, GEMMA3_SLIDING_PERIOD, GGUF_BIAS_ARCHS,
                                          GGUF_NORM_PLUS_ONE_ARCHS, GGUF_PERMUTED_QK_ARCHS,
                                          SMOLLM3_NO_ROPE_STEP, gemma3_query_pre_attn_scalar,
                                          gemma3_sliding_layers, hidden_act, permute_qk, smollm3_rope_layers)
from jaxsft.models.gguf.names import GGUF_ARCH_OF_MODEL_TYPE, gguf_tensor_name


def gguf_refusal(config) -> str | None:
  """Why `config` has no GGUF file that llama.cpp runs as jaxsft does (None: it has one).

  llama.cpp reads some settings from no key at all (src/llama-model.cpp): Gemma 3's sliding
  pattern (layer i slides iff i % 6 < 5), its sliding layers' RoPE base (10000) and its
  attention scale (1/sqrt(head_dim); 1/sqrt(hidden/heads) at 62 layers), SmolLM3's NoPE layers
  (every 4th). llama, qwen2, qwen3 and smollm3 have no sliding window in llama.cpp (olmo2's is
  OLMo 3's, which jaxsft does not write), and Llama-3 RoPE scaling would need the rope_freqs
  tensor jaxsft does not write.
  """
  kind = config.model_type
  arch = GGUF_ARCH_OF_MODEL_TYPE.get(kind)
  if arch is None:
    return f"no GGUF architecture for {kind}"
  layers = config.num_layers
  scaling = dict(config.rope_scaling or {})
  if scaling.get("rope_type") not in (None, "linear"):
    return (f"{scaling['rope_type']} RoPE scaling: llama.cpp stores it as a rope_freqs tensor, which jaxsft "
            f"does not write (linear scaling is written)")
  act = hidden_act(arch)
  if config.hidden_act != act:
    return f"llama.cpp's {arch} uses {act}, this model {config.hidden_act}"
  if arch not in GGUF_BIAS_ARCHS and (config.qkv_bias or config.o_bias or config.mlp_bias):
    return f"jaxsft writes {arch} without bias tensors"
  if arch == "gemma3":
    reason = _gemma3_refusal(config)
    if reason is not None:
      return reason
  elif arch != "phi3" and config.sliding_window is not None:
    return f"sliding-window attention (window {config.sliding_window}): jaxsft writes {arch} without one"
  if arch == "smollm3":
    rope = config.layer_rope or (True,) * layers
    if rope != smollm3_rope_layers(layers):
      return (f"llama.cpp's smollm3 leaves RoPE out of exactly the layers i with (i + 1) % "
              f"{SMOLLM3_NO_ROPE_STEP} == 0 (no GGUF key sets them); this model leaves it out of "
              f"{[i for i, r in enumerate(rope) if not r]}")
  return None


def _gemma3_refusal(config) -> str | None:
  """The Gemma 3 settings llama.cpp fixes without a key: sliding pattern, local RoPE base, scale."""
  layers = config.num_layers
  sliding = tuple(w is not None for w in config.layer_windows())
  if config.sliding_window is None or sliding != gemma3_sliding_layers(layers):
    return (f"llama.cpp's gemma3 slides exactly the layers i with i % {GEMMA3_SLIDING_PERIOD} < "
            f"{GEMMA3_SLIDING_PERIOD - 1} (no GGUF key sets the pattern); this model slides "
            f"{[i for i, s in enumerate(sliding) if s]} of {layers}")
  if config.rope_local_theta != GEMMA3_LOCAL_ROPE_BASE:
    return (f"llama.cpp's gemma3 fixes the sliding layers' RoPE base at {GEMMA3_LOCAL_ROPE_BASE:g}; "
            f"this model's is {config.rope_local_theta:g}")
  scalar = gemma3_query_pre_attn_scalar(layers, config.hidden_size, config.num_heads, config.head_dim)
  if config.query_pre_attn_scalar != scalar:
    return (f"llama.cpp's gemma3 scales attention by 1/sqrt({scalar}) (head_dim, or hidden/heads at 62 "
            f"layers) and reads no key for it; this model's query_pre_attn_scalar is "
            f"{config.query_pre_attn_scalar:g}")
  return None


def write_gguf(path: pathlib.Path, config, tensors: dict[str, np.ndarray], tokenizer_fields: dict[str, Any],
               dtype: str, name: str) -> None:
  """`tensors` (HF names, float32) as a GGUF file in llama.cpp's conventions for `config`'s
  family, with `tokenizer_fields` (`jaxsft.models.gguf.tokenizer.gguf_tokenizer_fields`) as its
  tokenizer. The caller checks `gguf_refusal` first."""
  import gguf

  arch = GGUF_ARCH_OF_MODEL_TYPE[config.model_type]
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_name(name)
  _add_model_metadata(writer, config, arch)
  file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
               "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
  writer.add_file_type(file_type)
  writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
  _add_tokenizer_metadata(writer, tokenizer_fields)
  for hf_name, value in tensors.items():
    if config.tie_word_embeddings and hf_name == "lm_head.weight":
      continue
    value = np.asarray(value, np.float32)
    if arch in GGUF_PERMUTED_QK_ARCHS and (".q_proj." in hf_name or ".k_proj." in hf_name):
      value = permute_qk(value, config.num_heads if ".q_proj." in hf_name else config.num_kv_heads)
    if arch in GGUF_NORM_PLUS_ONE_ARCHS and hf_name.endswith("norm.weight"):
      value = value + np.float32(1)
    _add_tensor(writer, gguf_tensor_name(hf_name, arch), value, dtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _add_model_metadata(writer, config, arch: str) -> None:
  """The `{arch}.*` keys llama.cpp reads for the family (sizes, RoPE, windows, vocabulary)."""
  import gguf

  writer.add_context_length(config.max_position_embeddings)
  writer.add_embedding_length(config.hidden_size)
  writer.add_block_count(config.num_layers)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_heads)
  writer.add_head_count_kv(config.num_kv_heads)
  writer.add_key_length(config.head_dim)
  writer.add_value_length(config.head_dim)
  writer.add_rope_dimension_count(config.rotary_dim)  # Phi-3: the partial rotary dims
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_rope_freq_base(config.rope_theta)
  if config.rope_scaling:  # linear (gguf_refusal): llama.cpp divides the frequencies by the factor
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(dict(config.rope_scaling)["factor"])
  if arch == "gemma3":
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_freq_base_swa(config.rope_local_theta)  # = llama.cpp's fixed base (gguf_refusal)
  elif arch == "phi3":  # as llama.cpp's converter: 0 for none
    writer.add_sliding_window(config.sliding_window or 0)
  writer.add_vocab_size(config.vocab_size)


def _add_tokenizer_metadata(writer, fields: dict[str, Any]) -> None:
  """The tokenizer.* keys: (value, field types) pairs copied from a GGUF keep their types."""
  import gguf

  for key, value in fields.items():
    if isinstance(value, tuple):  # copied from a GGUF: (value, field types)
      value, types = value
      if types[0] == gguf.GGUFValueType.ARRAY:
        writer.add_array(key, value)
      else:
        writer.add_key_value(key, value, types[0])
    elif isinstance(value, list):
      writer.add_array(key, value)
    elif isinstance(value, str):
      writer.add_string(key, value)
    else:
      writer.add_uint32(key, value)


def _add_tensor(writer, gguf_name: str, value: np.ndarray, dtype: str) -> None:
  """One float32 tensor stored as `dtype`; norms and biases stay float32, as llama.cpp keeps them."""
  import gguf
  from gguf import GGMLQuantizationType as Q

  if value.ndim == 1 or dtype == "float32":
    writer.add_tensor(gguf_name, np.ascontiguousarray(value, np.float32))
  elif dtype == "float16":
    writer.add_tensor(gguf_name, np.ascontiguousarray(value, np.float16))
  else:
    qtype = Q.BF16 if dtype == "bfloat16" else Q.Q8_0
    if qtype == Q.Q8_0 and value.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
      writer.add_tensor(gguf_name, np.ascontiguousarray(value, np.float16))  # rows not in 32-blocks
      return
    writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
