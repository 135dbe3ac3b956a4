"""GGUF names both ways, one table each: `general.architecture` <-> jaxsft model_type, and GGUF
tensor names <-> Hugging Face tensor names (as the `gguf` package's TensorNameMap maps each
architecture). Reading and writing use the same tables, so a written file reads back."""

from __future__ import annotations

import re

from jaxsft.errors import ModelError

FULL, SLIDING = "full_attention", "sliding_attention"
"""transformers' `layer_types` words in config.json, which GGUF metadata is read into (the
families read them too; they import them from here, so the GGUF package imports no model code)."""

# (jaxsft model_type, GGUF `general.architecture`). llama.cpp converts Mistral as llama; reading
# takes the first model_type listed for an architecture (a GGUF llama reads back as llama).
_ARCH_TABLE = (("llama", "llama"), ("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"),
               ("gemma3_text", "gemma3"), ("smollm3", "smollm3"), ("phi3", "phi3"), ("olmo2", "olmo2"))
GGUF_ARCH_OF_MODEL_TYPE = dict(_ARCH_TABLE)
"""jaxsft model_type -> the GGUF architecture export writes it as."""
MODEL_TYPE_OF_GGUF_ARCH = {arch: next(kind for kind, a in _ARCH_TABLE if a == arch) for _, arch in _ARCH_TABLE}
"""GGUF architecture -> the jaxsft model_type a file of it reads as."""

# GGUF tensor name (after `blk.{i}.`) -> Hugging Face name (after `model.layers.{i}.`).
# `_LLAMA_LAYER_NAMES` is Llama's.
_LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_PROJECTIONS = {k: v for k, v in _LLAMA_LAYER_NAMES.items() if k not in ("attn_norm", "ffn_norm")}
_LAYER_NAMES_BY_ARCH = {
    "llama": _LLAMA_LAYER_NAMES, "qwen2": _LLAMA_LAYER_NAMES, "smollm3": _LLAMA_LAYER_NAMES,
    "qwen3": {**_LLAMA_LAYER_NAMES, **_QK_NORMS},
    # Gemma 3: ffn_norm is the norm before the MLP; the norms after attention/MLP have their own names
    "gemma3": {**_PROJECTIONS, **_QK_NORMS, "attn_norm": "input_layernorm",
               "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "olmo2": {**_PROJECTIONS, **_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
    # Phi-3: q/k/v stay fused in attn_qkv, and ffn_up holds the fused gate_up (gate first)
    "phi3": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
             "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
}
GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                     "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
"""GGUF name -> Hugging Face name of the tensors outside the layers."""
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_layer_names(arch: str) -> dict[str, str]:
  """GGUF layer tensor name -> HF module path (both without the layer prefix) for `arch`."""
  return _LAYER_NAMES_BY_ARCH[arch]


def hf_tensor_name(gguf_name: str, arch: str, path: str) -> str:
  """The Hugging Face name of tensor `gguf_name` of a GGUF file (`path`, for the error) of `arch`."""
  if gguf_name in GGUF_GLOBAL_NAMES:
    return GGUF_GLOBAL_NAMES[gguf_name]
  layer_names = gguf_layer_names(arch)
  m = _LAYER_RE.match(gguf_name)
  if m is None or m.group(2) not in layer_names:
    raise ModelError(f"{path}: unknown GGUF tensor {gguf_name!r} for {arch}")
  return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
  """The GGUF name of a Hugging Face tensor name in GGUF architecture `arch`."""
  globals_ = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}
  if hf_name in globals_:
    return globals_[hf_name]
  layers = {v: k for k, v in gguf_layer_names(arch).items()}
  parts = hf_name.split(".")  # model.layers.{i}.<module path>.<leaf>
  if parts[:2] != ["model", "layers"]:
    raise ValueError(f"no GGUF name for tensor {hf_name!r}")
  module = ".".join(parts[3:-1])
  if module not in layers:
    raise ValueError(f"no GGUF name for tensor {hf_name!r} in GGUF architecture {arch}")
  return f"blk.{parts[2]}.{layers[module]}.{parts[-1]}"
