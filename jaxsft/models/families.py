"""The supported model families and their Hugging Face `config.json`, read into one `LlamaConfig`.

Every family is the same pre-built decoder (`jaxsft.models.decoder.CausalLM`) with a few switches;
this module says which switches each family sets and reads them from its config:

| model_type    | architecture         | what differs from Llama                                      |
| ------------- | -------------------- | ------------------------------------------------------------ |
| `llama`       | LlamaForCausalLM     | (the reference; Llama 2/3, SmolLM2; Llama-3 RoPE scaling)    |
| `mistral`     | MistralForCausalLM   | one sliding window on every layer                            |
| `qwen2`       | Qwen2ForCausalLM     | q/k/v biases; sliding windows on layers ≥ max_window_layers  |
| `qwen3`       | Qwen3ForCausalLM     | RMSNorm per head on q and k; optional sliding layers         |
| `gemma3_text` | Gemma3ForCausalLM    | x·(1 + w) norms, embeddings × √hidden, GeGLU (tanh GELU),    |
|               |                      | q/k norms, query_pre_attn_scalar, norms before and after     |
|               |                      | attention and MLP, sliding layers with their own RoPE base   |
| `smollm3`     | SmolLM3ForCausalLM   | no RoPE on the layers `no_rope_layers` marks 0               |
| `phi3`        | Phi3ForCausalLM      | fused `qkv_proj` and `gate_up_proj`, partial rotary          |
| `olmo2`       | Olmo2ForCausalLM     | norms after attention and MLP; q/k norms over the projection |

Per-layer differences (a layer's window, RoPE base, RoPE on or off) are tuples over layers in
the config; the model turns them into scanned per-layer indices, so the stack stays one
compiled layer body. Both the transformers 4 keys (`rope_theta`, `rope_scaling`,
`rope_local_base_freq`, `sliding_window_pattern`) and transformers 5's `rope_parameters`
(flat, or keyed by layer type) are read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from jaxsft.errors import ModelError
from jaxsft.models.gguf.names import FULL, SLIDING  # transformers' layer_types words, shared with the GGUF reader

# model_type -> the causal-LM architecture name. Anything else is refused.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
}
_SUPPORTED_ROPE = ("default", "llama3", "linear")
_SUPPORTED_ACT = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The architecture of any supported family. Hashable (it is static data of the graph).

  Defaults are Llama's; the family switches are:
    qk_norm: None, "head" (RMSNorm over each head's q/k, Qwen3 and Gemma 3) or "projection"
      (over the whole q/k projection, OLMo 2).
    norm_placement: "pre" (h += f(norm(h))), "post" (h += norm(f(h)), OLMo 2) or "sandwich"
      (h += norm(f(norm(h))), Gemma 3).
    norm_unit_offset: RMSNorm scales by (1 + w) (Gemma). norm_weight_float32: the weight
      multiplies in float32 before the cast (Gemma 3, OLMo 2; Llama casts first).
    scale_embeddings: the input embedding is multiplied by √hidden_size (Gemma).
    hidden_act: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU).
    query_pre_attn_scalar: attention scale is its -1/2 power instead of head_dim's.
    fused_projections: one `qkv_proj` and one `gate_up_proj` (Phi-3).
    partial_rotary_factor: RoPE turns only the first factor·head_dim dimensions (Phi-3).
    sliding_window: the window of the sliding layers; `layer_sliding` says which layers
      (None: every layer when `sliding_window` is set).
    rope_local_theta: the RoPE base of the sliding layers (Gemma 3; None: `rope_theta`).
    layer_rope: per layer, whether it applies RoPE at all (SmolLM3; None: every layer).
    rope_scaling: sorted (key, value) pairs with "rope_type" "llama3" or "linear" (the full-
      attention layers' scaling; sliding layers of Gemma 3 use plain RoPE).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  sliding_window: int | None = None
  model_type: str = "llama"
  max_position_embeddings: int = 2048
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  qk_norm: str | None = None
  norm_placement: str = "pre"
  norm_unit_offset: bool = False
  norm_weight_float32: bool = False
  scale_embeddings: bool = False
  hidden_act: str = "silu"
  query_pre_attn_scalar: float | None = None
  fused_projections: bool = False
  partial_rotary_factor: float = 1.0
  layer_sliding: tuple[bool, ...] | None = None
  rope_local_theta: float | None = None
  layer_rope: tuple[bool, ...] | None = None

  def __post_init__(self):
    for name in ("layer_sliding", "layer_rope"):
      value = getattr(self, name)
      if value is not None and len(value) != self.num_layers:
        raise ValueError(f"{name} has {len(value)} entries for {self.num_layers} layers")
    if self.qk_norm not in (None, "head", "projection"):
      raise ValueError(f"qk_norm must be None, 'head' or 'projection', got {self.qk_norm!r}")
    if self.norm_placement not in ("pre", "post", "sandwich"):
      raise ValueError(f"norm_placement must be 'pre', 'post' or 'sandwich', got {self.norm_placement!r}")
    if self.hidden_act not in _SUPPORTED_ACT:
      raise ValueError(f"hidden_act must be one of {_SUPPORTED_ACT}, got {self.hidden_act!r}")

  @property
  def architecture(self) -> str:
    return SUPPORTED_MODEL_TYPES[self.model_type]

  @property
  def rotary_dim(self) -> int:
    return int(self.head_dim * self.partial_rotary_factor)

  def layer_windows(self) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full causal attention)."""
    if self.sliding_window is None:
      return (None,) * self.num_layers
    sliding = self.layer_sliding or (True,) * self.num_layers
    return tuple(self.sliding_window if s else None for s in sliding)

  def layer_rope_kinds(self) -> tuple[str, ...]:
    """Each layer's RoPE: "global" (rope_theta, rope_scaling), "local" (rope_local_theta, the
    sliding layers of Gemma 3) or "none" (SmolLM3's NoPE layers)."""
    windows = self.layer_windows()
    uses_rope = self.layer_rope or (True,) * self.num_layers
    return tuple("none" if not rope else "local" if (self.rope_local_theta is not None and w is not None)
                 else "global" for rope, w in zip(uses_rope, windows))

  @property
  def attention_scale(self) -> float:
    return float(self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5


# model_type -> the switches that are fixed for the family (the rest is read from the config).
_FAMILY_SWITCHES: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "smollm3": {},
    "qwen2": {"qkv_bias": True, "o_bias": False},  # Qwen2 always has q/k/v biases, never an o_proj bias
    "qwen3": {"qk_norm": "head"},
    "gemma3_text": {"qk_norm": "head", "norm_placement": "sandwich", "norm_unit_offset": True,
                    "norm_weight_float32": True, "scale_embeddings": True},
    "phi3": {"fused_projections": True},
    "olmo2": {"qk_norm": "projection", "norm_placement": "post", "norm_weight_float32": True},
}


def _get(cfg: Mapping[str, Any], *keys, default=None):
  for k in keys:
    if cfg.get(k) is not None:
      return cfg[k]
  return default


def _rope_params(cfg: Mapping[str, Any], layer_type: str) -> dict[str, Any]:
  """One layer type's RoPE parameters from `rope_parameters` (flat or keyed by layer type)
  merged with the legacy `rope_theta` / `rope_scaling` keys."""
  params = dict(cfg.get("rope_parameters") or {})
  if FULL in params or SLIDING in params:
    params = dict(params.get(layer_type) or params.get(FULL) or {})
  legacy = dict(cfg.get("rope_scaling") or {}) if layer_type == FULL else {}
  params.update({k: v for k, v in legacy.items() if k not in params})
  if "rope_theta" not in params:
    theta = cfg.get("rope_local_base_freq") if layer_type == SLIDING else None
    params["rope_theta"] = theta if theta is not None else cfg.get("rope_theta", 10000.0)
  params.setdefault("rope_type", params.pop("type", "default"))
  if "partial_rotary_factor" not in params and cfg.get("partial_rotary_factor") is not None:
    params["partial_rotary_factor"] = cfg["partial_rotary_factor"]
  return params


def _rope_scaling(params: Mapping[str, Any], model_type: str) -> tuple[tuple[str, Any], ...] | None:
  rope_type = params["rope_type"]
  if rope_type not in _SUPPORTED_ROPE:
    raise ValueError(f"unsupported rope type {rope_type!r} for {model_type}: jaxsft supports {_SUPPORTED_ROPE}")
  if rope_type == "default":
    return None
  keys = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
          "linear": ("factor",)}[rope_type]
  missing = [k for k in keys if k not in params]
  if missing:
    raise ValueError(f"{rope_type} rope scaling is missing {missing} in the config of {model_type}")
  def number(k):
    return int(params[k]) if k == "original_max_position_embeddings" else float(params[k])

  return tuple(sorted([("rope_type", rope_type), *((k, number(k)) for k in keys)]))


def _layer_types(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> list[str]:
  """Each layer's attention type, as transformers derives it when `layer_types` is absent."""
  if cfg.get("layer_types"):
    return list(cfg["layer_types"])
  window = cfg.get("sliding_window")
  if model_type == "gemma3_text":
    pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
  if model_type in ("qwen2", "qwen3"):
    first = int(cfg.get("max_window_layers", num_layers))
    return [SLIDING if cfg.get("use_sliding_window") and window is not None and i >= first else FULL
            for i in range(num_layers)]
  if model_type == "smollm3":
    no_rope = cfg.get("no_rope_layers") or [1] * num_layers
    return [SLIDING if cfg.get("use_sliding_window") and window is not None and not no_rope[i] else FULL
            for i in range(num_layers)]
  return [SLIDING if window is not None else FULL] * num_layers  # mistral, phi3: one window everywhere


def _hashable(value):
  return tuple(value) if isinstance(value, list) else value  # Llama 3, Gemma 3: several eos ids


def check_architecture(cfg: Mapping[str, Any]) -> None:
  """`ValueError` naming the architecture and listing the supported ones, unless `config.json`'s
  model_type (and architectures) is a causal LM family jaxsft builds."""
  model_type = cfg.get("model_type")
  supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODEL_TYPES.items())
  if model_type == "gemma3" and "text_config" in cfg:
    raise ValueError("unsupported architecture: model_type='gemma3' is the multimodal Gemma 3 "
                     "(Gemma3ForConditionalGeneration); jaxsft loads the text-only Gemma 3 "
                     "(model_type 'gemma3_text', Gemma3ForCausalLM, e.g. gemma-3-1b)")
  if model_type not in SUPPORTED_MODEL_TYPES:
    archs = cfg.get("architectures") or []
    raise ValueError(f"unsupported architecture: model_type={model_type!r} architectures={archs}; "
                     f"jaxsft supports {supported}")
  for arch in cfg.get("architectures") or []:
    if arch != SUPPORTED_MODEL_TYPES[model_type]:
      raise ValueError(f"unsupported architecture {arch!r} (model_type {model_type!r}): jaxsft builds "
                       f"causal LMs only ({SUPPORTED_MODEL_TYPES[model_type]})")


def from_hf_config(hf_config) -> LlamaConfig:
  """A `LlamaConfig` from a transformers config object or a `config.json` dict.

  Raises `ValueError` naming the architecture (and listing the supported ones) when it is not
  supported, and naming the field when a supported family uses an option jaxsft lacks.
  """
  cfg = dict(hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict())
  check_architecture(cfg)
  model_type = cfg["model_type"]
  act = _activation(cfg, model_type)

  num_layers = int(cfg["num_hidden_layers"])
  num_heads = int(cfg["num_attention_heads"])
  hidden = int(cfg["hidden_size"])
  switches = dict(_FAMILY_SWITCHES[model_type])
  sliding, window = _sliding_layers(cfg, model_type, num_layers)

  full_rope = _rope_params(cfg, FULL)
  partial = float(full_rope.get("partial_rotary_factor", 1.0))
  if partial != 1.0 and model_type != "phi3":
    raise ValueError(f"unsupported partial_rotary_factor {partial} for {model_type}")
  rope_local_theta = _local_rope_theta(cfg, model_type, sliding)
  layer_rope = _layer_rope(cfg, model_type, num_layers)

  attention_bias = bool(cfg.get("attention_bias", False))
  fields = dict(qkv_bias=attention_bias, o_bias=attention_bias)
  if model_type == "gemma3_text":
    fields["query_pre_attn_scalar"] = float(cfg.get("query_pre_attn_scalar", cfg.get("head_dim", hidden // num_heads)))
  fields.update(switches)
  return LlamaConfig(
      vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
      intermediate_size=int(cfg["intermediate_size"]), num_layers=num_layers,
      num_heads=num_heads, num_kv_heads=int(_get(cfg, "num_key_value_heads", default=num_heads)),
      head_dim=int(_get(cfg, "head_dim", default=hidden // num_heads)),
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(full_rope["rope_theta"]),
      rope_scaling=_rope_scaling(full_rope, model_type),
      tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "gemma3_text")),
      mlp_bias=bool(cfg.get("mlp_bias", False)),
      sliding_window=None if window is None else int(window),
      layer_sliding=None if all(sliding) or not any(sliding) else tuple(sliding),
      model_type=model_type, max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
      bos_token_id=cfg.get("bos_token_id"), eos_token_id=_hashable(cfg.get("eos_token_id")),
      pad_token_id=cfg.get("pad_token_id"), hidden_act=act, partial_rotary_factor=partial,
      rope_local_theta=rope_local_theta, layer_rope=layer_rope, **fields)


def _activation(cfg: dict, model_type: str) -> str:
  """The MLP activation, after refusing the options of the family jaxsft lacks (softcapping,
  bidirectional attention)."""
  act = _get(cfg, "hidden_activation", "hidden_act", default="silu")
  if act not in _SUPPORTED_ACT:
    raise ValueError(f"unsupported hidden_act {act!r} for {model_type}: jaxsft supports {_SUPPORTED_ACT}")
  for field in ("final_logit_softcapping", "attn_logit_softcapping"):
    if cfg.get(field) is not None:
      raise ValueError(f"unsupported {field}={cfg[field]} for {model_type}")
  if cfg.get("use_bidirectional_attention"):
    raise ValueError(f"unsupported use_bidirectional_attention=True for {model_type}")
  return act


def _sliding_layers(cfg: dict, model_type: str, num_layers: int) -> tuple[list[bool], Any]:
  """(whether each layer slides, the window): no layer slides without a window."""
  layer_types = _layer_types(cfg, model_type, num_layers)
  if len(layer_types) != num_layers or set(layer_types) - {FULL, SLIDING}:
    raise ValueError(f"layer_types of {model_type} must be {num_layers} of {FULL!r}/{SLIDING!r}: {layer_types}")
  sliding = [t == SLIDING for t in layer_types]
  window = cfg.get("sliding_window") if any(sliding) else None
  if window is None:
    sliding = [False] * num_layers
  return sliding, window


def _local_rope_theta(cfg: dict, model_type: str, sliding: list[bool]) -> float | None:
  """Gemma 3's RoPE base of its sliding layers (None: other families, or no sliding layer)."""
  if model_type != "gemma3_text" or not any(sliding):
    return None
  local = _rope_params(cfg, SLIDING)
  if _rope_scaling(local, model_type) is not None:
    raise ValueError(f"unsupported rope scaling {local['rope_type']!r} on the sliding layers of {model_type}")
  return float(local["rope_theta"])


def _layer_rope(cfg: dict, model_type: str, num_layers: int) -> tuple[bool, ...] | None:
  """SmolLM3's RoPE switch per layer (None: RoPE in every layer)."""
  if model_type != "smollm3" or cfg.get("no_rope_layers") is None:
    return None
  layer_rope = tuple(bool(x) for x in cfg["no_rope_layers"])
  if len(layer_rope) != num_layers:
    raise ValueError(f"no_rope_layers has {len(layer_rope)} entries for {num_layers} layers")
  return None if all(layer_rope) else layer_rope


def to_hf_config(config: LlamaConfig) -> dict[str, Any]:
  """The `config.json` dict transformers reads back into the same architecture (and
  `from_hf_config` back into `config`)."""
  model_type = config.model_type
  out: dict[str, Any] = {
      "architectures": [config.architecture], "model_type": model_type,
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
      "tie_word_embeddings": config.tie_word_embeddings,
      "max_position_embeddings": config.max_position_embeddings,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id,
      "pad_token_id": config.pad_token_id,
  }
  out["hidden_activation" if model_type == "gemma3_text" else "hidden_act"] = config.hidden_act
  full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
  if config.rope_scaling:
    full_rope.update(dict(config.rope_scaling))
  if config.partial_rotary_factor != 1.0:
    full_rope["partial_rotary_factor"] = config.partial_rotary_factor
  layer_types = [SLIDING if w is not None else FULL for w in config.layer_windows()]
  if model_type == "gemma3_text":
    local_theta = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
    out["rope_parameters"] = {FULL: full_rope, SLIDING: {"rope_type": "default", "rope_theta": local_theta}}
    # transformers 4 reads these instead
    out.update(rope_theta=config.rope_theta, rope_local_base_freq=local_theta,
               rope_scaling=None if not config.rope_scaling else dict(config.rope_scaling))
    scalar = config.query_pre_attn_scalar
    out.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar, final_logit_softcapping=None,
               attn_logit_softcapping=None, attention_bias=config.qkv_bias)
  else:
    out["rope_parameters"] = full_rope
    out["rope_theta"] = config.rope_theta
    if config.rope_scaling:
      out["rope_scaling"] = dict(config.rope_scaling)
    if config.partial_rotary_factor != 1.0:
      out["partial_rotary_factor"] = config.partial_rotary_factor
  if model_type in ("llama", "smollm3"):
    out.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
  if model_type in ("qwen3", "olmo2"):
    out["attention_bias"] = config.qkv_bias
  if model_type in ("mistral", "phi3"):
    out["sliding_window"] = config.sliding_window
  if model_type in ("qwen2", "qwen3", "gemma3_text", "smollm3"):
    out.update(sliding_window=config.sliding_window, layer_types=layer_types)
    if model_type != "gemma3_text":
      out["use_sliding_window"] = config.sliding_window is not None
    if model_type in ("qwen2", "qwen3"):
      sliding = [t == SLIDING for t in layer_types]
      out["max_window_layers"] = sliding.index(True) if any(sliding) else config.num_layers
  if model_type == "smollm3":
    out["no_rope_layers"] = [int(r) for r in (config.layer_rope or (True,) * config.num_layers)]
  return out


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
    check_architecture(hf_config) if architecture_only else from_hf_config(hf_config)
  except (ValueError, KeyError, TypeError) as e:
    raise ModelError(f"{config_path}: {e if not isinstance(e, KeyError) else f'field {e} is missing'}") from None
  return hf_config
