"""Load a `CausalLM` from a Hugging Face directory / hub id (safetensors) or a GGUF file.

No torch: `config.json` is read as JSON, weights with `safetensors.numpy`, GGUF with the `gguf`
package (numpy dequantization). transformers' own GGUF loader needs torch, so llama.cpp's
conventions are undone here, per GGUF architecture (`general.architecture`):

| GGUF arch | jaxsft family | read as llama.cpp runs it                                            |
| --------- | ------------- | -------------------------------------------------------------------- |
| llama     | llama         | q/k rows permuted (llama.cpp's `LlamaModel.permute`)                 |
| qwen2     | qwen2         | q/k/v biases                                                         |
| qwen3     | qwen3         | `attn_q_norm`/`attn_k_norm`; no sliding window                       |
| gemma3    | gemma3_text   | every `*norm.weight` stored as 1 + w; layer i sliding iff i % 6 < 5; |
|           |               | sliding layers at RoPE base 10000, unscaled; attention scale         |
|           |               | 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer 27B)         |
| smollm3   | smollm3       | q/k rows permuted; no RoPE on layers i with (i + 1) % 4 == 0         |
| phi3      | phi3          | fused `attn_qkv`, `ffn_up` = gate_up; rope.dimension_count rotary    |
|           |               | dims (partial rotary); attention.sliding_window (0: none)            |
| olmo2     | olmo2         | `post_attention_norm`/`post_ffw_norm`, q/k norms over the projection |

(llama.cpp's `src/llama-model.cpp` hard-codes the Gemma 3 pattern, local base and scale and
the SmolLM3 NoPE step: no GGUF key carries them.) A file whose metadata llama.cpp builds would
read differently, or that jaxsft cannot represent, is refused naming the key. Dequantized GGUF
weights are cached as safetensors (float32, so the cache is exact) under
`ModelSource.cache_dir`, written to a temporary name and renamed, so a second load skips
dequantization and a crash never leaves a half-written cache behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from jaxsft import io
from jaxsft.errors import ModelError
from jaxsft.models import families, llama
from jaxsft.models.families import FULL, SLIDING
from jaxsft.models.hub import ModelSource, load_tokenizer, resolve_model

# GGUF `general.architecture` -> jaxsft model_type.
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
               "smollm3": "smollm3", "phi3": "phi3", "olmo2": "olmo2"}
# GGUF tensor name (after `blk.{i}.`) -> Hugging Face name (after `model.layers.{i}.`), as the
# `gguf` package's TensorNameMap maps each architecture. `_GGUF_LAYER_NAMES` is Llama's.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_PROJECTIONS = {k: v for k, v in _GGUF_LAYER_NAMES.items() if k not in ("attn_norm", "ffn_norm")}
_GGUF_LAYER_NAMES_BY_ARCH = {
    "llama": _GGUF_LAYER_NAMES, "qwen2": _GGUF_LAYER_NAMES, "smollm3": _GGUF_LAYER_NAMES,
    "qwen3": {**_GGUF_LAYER_NAMES, **_QK_NORMS},
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
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# llama.cpp's converter permutes q/k rows for the archs it runs with "normal" (interleaved-pair)
# RoPE: LlamaModel and its subclass SmolLM3Model (`undo_permute = True`); the others are rotate-half.
GGUF_PERMUTED_QK_ARCHS = ("llama", "smollm3")
# Gemma's converters store every `*norm.weight` as 1 + w (llama.cpp multiplies by the weight).
GGUF_NORM_PLUS_ONE_ARCHS = ("gemma3",)
# Fixed by llama.cpp for these archs (src/llama-model.cpp, no GGUF key): Gemma 3's sliding
# pattern (layer i slides iff i % 6 < 5) and sliding-layer RoPE base; SmolLM3's NoPE step.
GEMMA3_SLIDING_PERIOD = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
SMOLLM3_NO_ROPE_STEP = 4


def gguf_layer_names(arch: str) -> dict[str, str]:
  """GGUF layer tensor name -> HF module path (both without the layer prefix) for `arch`."""
  return _GGUF_LAYER_NAMES_BY_ARCH[arch]


def gemma3_sliding_layers(num_layers: int, period: int = GEMMA3_SLIDING_PERIOD) -> tuple[bool, ...]:
  """Which layers llama.cpp's `set_swa_pattern(period)` makes sliding (all but every period-th)."""
  return tuple(i % period < period - 1 for i in range(num_layers))


def smollm3_rope_layers(num_layers: int) -> tuple[bool, ...]:
  """Which layers llama.cpp's smollm3 graph rotates (`(il + 1) % n_no_rope_layer_step != 0`)."""
  return tuple((i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(num_layers))


def gemma3_query_pre_attn_scalar(num_layers: int, hidden: int, num_heads: int, head_dim: int) -> int:
  """The attention scale llama.cpp's gemma3 uses, as a query_pre_attn_scalar: head_dim, except
  hidden / heads for the 62-layer Gemma 3 27B."""
  return hidden // num_heads if num_layers == 62 else head_dim


_CACHE_FORMAT = "2"


def load_model(name_or_path: str, *, dtype: str = "float32", attention: str = "xla",
               remat: str | Callable | None = llama.DEFAULT_REMAT, quantize: str = "none",
               quant_block_size: int = 64):
  """`(model, tokenizer)` for a short name, HF directory, hub id or `.gguf` file.

  Args:
    name_or_path: e.g. "smollm2-135m-instruct", "/path/to/hf_dir", "org/name", "x.gguf".
    dtype: "float32" or "bfloat16" for the base weights and the compute.
    attention, remat: see `CausalLM`.
    quantize, quant_block_size: store the projection kernels block-quantized (`jaxsft.quant`):
      none, int8, nf4, int4 (blocks of `quant_block_size` inputs) or gguf (a GGUF file's own
      Q4_0 / Q4_1 / Q8_0 blocks).
  """
  source = resolve_model(name_or_path)
  model = load_causal_lm(source, dtype=dtype, attention=attention, remat=remat, quantize=quantize,
                         quant_block_size=quant_block_size)
  return model, load_tokenizer(source)


def load_causal_lm(source: ModelSource | str, *, dtype: str = "float32", attention: str = "xla",
                   remat: str | Callable | None = llama.DEFAULT_REMAT, quantize: str = "none",
                   quant_block_size: int = 64) -> llama.CausalLM:
  """The model alone (no tokenizer): `load_model` without the tokenizer files."""
  from jaxsft import quant

  if quantize not in quant.QUANTIZE_CHOICES:
    raise ValueError(f"quantize must be one of {list(quant.QUANTIZE_CHOICES)}, got {quantize!r}")
  if isinstance(source, str):
    source = resolve_model(source)
  if quantize == "gguf" and source.gguf_file is None:
    raise ValueError(f"model.quantize=gguf keeps a GGUF file's own blocks, but {source.name!r} is not a .gguf "
                     f"file (use int8, nf4 or int4)")
  if source.gguf_file is not None:
    hf_config, tensors, where = load_gguf_cached(source)
  else:
    folder = _local_folder(source)
    hf_config, tensors, where = _read_hf_folder(folder)
  config = llama.from_hf_config(hf_config)
  model = llama.from_hf_state_dict(config, tensors, dtype=dtype, source=where, attention=attention,
                                   remat=remat)
  model.name_or_path = source.name  # recorded as base_model_name_or_path in adapter configs
  if quantize == "gguf":
    quant.load_gguf_blocks(model, pathlib.Path(source.path) / source.gguf_file)
  elif quantize != "none":
    quant.quantize_model(model, quantize, quant_block_size)
  return model


def _local_folder(source: ModelSource) -> pathlib.Path:
  if not source.is_hub_id:
    return pathlib.Path(source.path)
  from huggingface_hub import snapshot_download  # honours HF_HUB_OFFLINE

  return pathlib.Path(snapshot_download(source.path, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                                      "*.txt"]))


def read_hf_config(folder: str | os.PathLike, *, architecture_only: bool = False) -> dict:
  """FOLDER/config.json, refused (`ModelError` naming the file and the architecture, with the
  supported list) unless jaxsft builds that model: checked before any weight or tokenizer is read.
  `architecture_only`: only the family is checked (a tokenizer folder's config may hold no more)."""
  config_path = pathlib.Path(folder) / "config.json"
  try:
    hf_config = json.loads(config_path.read_text())
  except json.JSONDecodeError as e:
    raise ModelError(f"{config_path}: line {e.lineno}: invalid JSON ({e.msg})") from None
  except (RecursionError, UnicodeDecodeError) as e:
    raise ModelError(f"{config_path}: invalid JSON ({e})") from None
  if not isinstance(hf_config, dict):
    raise ModelError(f"{config_path}: expected a JSON object, got {type(hf_config).__name__}")
  try:
    families.check_architecture(hf_config) if architecture_only else llama.from_hf_config(hf_config)
  except (ValueError, KeyError, TypeError) as e:
    raise ModelError(f"{config_path}: {e if not isinstance(e, KeyError) else f'field {e} is missing'}") from None
  return hf_config


def _read_hf_folder(folder: pathlib.Path) -> tuple[dict, dict[str, np.ndarray], str]:
  from safetensors.numpy import load_file

  hf_config = read_hf_config(folder)
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


def _field(reader, key: str, default=None):
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
    return _field(self.reader, f"{self.arch}.{key}", default)

  def need(self, key: str):
    value = self.get(key)
    if value is None:
      raise ValueError(f"{self.path}: GGUF metadata field {self.arch}.{key} is missing")
    return value

  def refuse(self, key: str, why: str) -> NoReturn:
    raise ValueError(f"{self.path}: {self.arch}.{key} = {self.get(key)!r}: {why}")


def gguf_config(reader, path: str) -> dict[str, Any]:
  """A transformers-style `config.json` dict from GGUF metadata, read as llama.cpp reads it.

  Raises `ValueError` naming the file and the key for an architecture jaxsft does not read, and
  for metadata llama.cpp would run differently from any jaxsft model (softcapping, LongRoPE and
  YaRN, bias tensors on the archs llama.cpp builds without them, OLMo 3's sliding windows, a Gemma
  3 pattern or local RoPE base that llama.cpp's builds disagree on).
  """
  arch = _field(reader, "general.architecture")
  if arch not in _GGUF_ARCHS:
    raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; jaxsft reads {sorted(_GGUF_ARCHS)}")
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names:
    raise ValueError(f"{path}: GGUF with rope_freqs.weight (Llama-3.1 rope scaling baked into a tensor) "
                     f"is not supported; load the Hugging Face directory instead")
  if names & {"rope_factors_long.weight", "rope_factors_short.weight"}:
    raise ValueError(f"{path}: GGUF with rope_factors_long/short (Phi-3 LongRoPE) is not supported; jaxsft "
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
    vocab = len(meta.reader.fields["tokenizer.ggml.tokens"].data)
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    if meta.get(key) not in (None, 0.0):
      meta.refuse(key, "jaxsft has no logit softcapping")
  model_type = _GGUF_ARCHS[arch]
  if arch not in ("llama", "qwen2") and any(n.endswith(".bias") for n in names):
    raise ValueError(f"{path}: GGUF {arch} with bias tensors is not supported (jaxsft's {model_type} has none)")
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
      "bos_token_id": _field(meta.reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": _field(meta.reader, "tokenizer.ggml.eos_token_id"),
      "pad_token_id": _field(meta.reader, "tokenizer.ggml.padding_token_id"),
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


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's `permute` of q/k rows (interleaved RoPE pairs -> rotate-half halves).

  llama.cpp's convert script reshapes rows as (n_head, 2, d/2) and swaps the last two axes; the
  inverse reshapes as (n_head, d/2, 2) and swaps back.
  """
  rows = weight.shape[0]
  w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
  return w.swapaxes(1, 2).reshape(weight.shape)


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """`(hf_config, hf_named_float32_tensors)` from a GGUF file, dequantized with numpy, with
  llama.cpp's q/k permutation and Gemma's 1 + w norms undone."""
  from gguf.quants import dequantize

  path = str(path)
  reader = open_gguf(path)
  config = gguf_config(reader, path)
  arch = _field(reader, "general.architecture")
  layer_names = gguf_layer_names(arch)
  tensors: dict[str, np.ndarray] = {}
  layer_re = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
  for t in reader.tensors:
    if t.name in _GGUF_GLOBAL_NAMES:
      name = _GGUF_GLOBAL_NAMES[t.name]
    else:
      m = layer_re.match(t.name)
      if m is None or m.group(2) not in layer_names:
        raise ValueError(f"{path}: unknown GGUF tensor {t.name!r} for {arch}")
      name = f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    value = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
    if arch in GGUF_PERMUTED_QK_ARCHS and t.name.split(".")[-2] in ("attn_q", "attn_k"):
      heads = config["num_attention_heads"] if ".attn_q." in t.name else config["num_key_value_heads"]
      value = unpermute_qk(value, heads)
    if arch in GGUF_NORM_PLUS_ONE_ARCHS and t.name.endswith("norm.weight"):
      value = value - np.float32(1)
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
  with io.atomic_path(weights) as tmp:
    save_file(tensors, str(tmp))
  io.write_json(config_file, {**hf_config, "_jaxsft_gguf_stamp": stamp})  # last: its stamp marks the cache complete
  return hf_config, tensors, str(gguf_path)
