"""Every allowed value of the config tree and every check of a `TrainConfig`, in one place.

The lists of choices live here, not in the modules that act on them, so the config reads them
without importing those modules (the data pipeline, the quantized models): `jaxsft.data`,
`jaxsft.quant` and the commands import them from here. A value is checked twice: as it is read
(`check_choice`, `check_range`: a YAML file's or the command line's key, named with its source),
and as a whole before a run starts (`validate`: also a config built in code, and the rules that
tie keys together). Checks that need a fact known only at run time (the devices, the model's
parameters, the run directory) stay where the fact is known and raise the same `ConfigError`.

This module imports nothing of jaxsft but its errors: every layer may import it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from jaxsft.errors import ConfigError

FORMATS = ("alpaca", "messages", "sharegpt", "prompt_completion")
"""`data.format` (besides auto): the record formats `jaxsft.data.records` reads."""
ON_ERROR = ("raise", "skip")
"""`data.on_error`: a bad record stops the run, or is counted and skipped."""
TRAIN_ON = ("all_assistant", "last")
"""`data.train_on`: which assistant replies are trained."""
BATCHING = ("static", "dynamic", "bucketed", "packed", "bucketed_packed")
"""The batching modes of `jaxsft.data.pipeline` (`data.batching` also takes auto)."""
QUANTIZE_CHOICES = ("none", "int8", "nf4", "int4", "gguf")
"""`model.quantize`: none, a `jaxsft.quant.formats` format made at load time, or gguf (the
file's own Q4_0 / Q4_1 / Q8_0 blocks)."""
QUANT_BLOCK_SIZE = 32
"""`model.quant_block_size` by default: inputs per block, 32, GGUF's own block, at 16-bit scales
(`jaxsft.quant.formats.DEFAULT_BLOCK`)."""
DTYPES = ("auto", "float32", "bfloat16")
"""`model.dtype`."""

CHOICES = {
    "mode": ("lora", "full"),
    "model.dtype": DTYPES,
    "model.remat": ("dots_no_batch", "dots", "full", "none"),
    "model.quantize": QUANTIZE_CHOICES,
    "data.batching": BATCHING + ("auto",),
    "data.num_buckets": ("auto",),
    "data.train_on": TRAIN_ON,
    "data.on_error": ON_ERROR,
    "data.format": ("auto",) + FORMATS,
    "optim.schedule": ("cosine", "linear", "constant"),
    "logging.wandb_mode": ("online", "offline"),
}
"""The words each string key allows (for `data.num_buckets`, the word it allows besides a number)."""


def _at_least(low):
  return f">= {low}", lambda v: v >= low


def _between(low, high, *, high_inclusive=False):
  return (f"in [{low}, {high}{']' if high_inclusive else ')'}",
          lambda v: low <= v <= high if high_inclusive else low <= v < high)


_POSITIVE = ("> 0", lambda v: v > 0)
# The allowed range of each numeric key (None, where a key allows it, is always allowed; a
# tuple's every entry is checked). A float must also be finite.
RANGES = {
    "lora.r": _at_least(1), "lora.alpha": _POSITIVE, "lora.dropout": _between(0, 1),
    "data.val_fraction": _between(0, 1), "data.max_val_examples": _at_least(0),
    "data.synthetic_size": _at_least(1), "data.max_length": _at_least(1), "data.num_buckets": _at_least(1),
    "data.bucket_lengths": _at_least(1), "data.batch_size": _at_least(1), "data.tokens_per_batch": _at_least(1),
    "data.pad_to_multiple_of": _at_least(1), "data.worker_count": _at_least(0),
    "optim.lr": _POSITIVE, "optim.weight_decay": _at_least(0), "optim.b1": _between(0, 1),
    "optim.b2": _between(0, 1), "optim.eps": _POSITIVE, "optim.warmup_steps": _at_least(0),
    "optim.warmup_ratio": _between(0, 1, high_inclusive=True), "optim.max_grad_norm": _POSITIVE,
    "optim.grad_accum": _at_least(1),
    "mesh.data": ("-1 (all devices left) or >= 1", lambda v: v == -1 or v >= 1), "mesh.fsdp": _at_least(1),
    "eval.eval_every": _at_least(0), "eval.early_stopping_patience": _at_least(1), "eval.num_prompts": _at_least(0),
    "eval.max_new_tokens": _at_least(1),
    "epochs": _at_least(1), "max_steps": _at_least(1), "save_every": _at_least(0), "keep_checkpoints": _at_least(1),
    "max_nonfinite_steps": _at_least(1), "neftune_noise_alpha": _at_least(0),
}


def check_choice(key: str, value: str) -> None:
  """`ConfigError` naming the key when a string is not one of `CHOICES[key]`."""
  if key in CHOICES and value not in CHOICES[key]:
    raise ConfigError(f"{key}: {value!r} is not one of {list(CHOICES[key])}")


def check_range(key: str, value, source: str = "command line") -> None:
  """`ConfigError` naming the key when a number is outside `RANGES[key]` or not finite."""
  values = value if isinstance(value, tuple) else (value,)
  for v in values:
    if isinstance(v, float) and not math.isfinite(v):
      raise ConfigError(f"{source}: {key} must be a finite number, got {v}")
    if key in RANGES and isinstance(v, (int, float)) and not isinstance(v, bool):
      what, ok = RANGES[key]
      if not ok(v):
        raise ConfigError(f"{source}: {key} must be {what}, got {v}")


def validate(cfg) -> None:
  """Every check of a `TrainConfig` that needs nothing but the config: each key's choices and
  range (again, for a config built in code rather than read), then the rules between keys.
  Raises `ConfigError` naming the key; run before anything is loaded or written."""
  for key, value in _leaves(cfg):
    if isinstance(value, str):
      check_choice(key, value)
    check_range(key, value, source="config")
  _check_model(cfg)
  _check_trainable(cfg)
  check_data_sources(cfg.data)
  _check_batching(cfg.data)


def _leaves(obj, prefix: str = "") -> list[tuple[str, Any]]:
  """(dotted key, value) of every leaf of the dataclass tree."""
  out = []
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      out += _leaves(value, f"{prefix}{f.name}.")
    else:
      out.append((prefix + f.name, value))
  return out


def _check_model(cfg) -> None:
  template = cfg.model.chat_template
  if template is not None and not os.path.exists(os.path.expanduser(template)):
    raise ConfigError(f"model.chat_template: {template}: no such file or folder")
  """Model settings that cannot go together."""
  if cfg.model.quantize_embeddings and cfg.model.quantize == "none":
    raise ConfigError("model.quantize_embeddings=true needs a model.quantize format (int8, nf4, int4 "
                      "or gguf) for the embeddings to be stored in")
  if cfg.model.quantize != "none" and cfg.mode == "full":
    raise ConfigError(f"model.quantize={cfg.model.quantize}: a quantized base is frozen, so it trains "
                      f"LoRA adapters only; use mode=lora or model.quantize=none with mode=full")


def _check_trainable(cfg) -> None:
  """mode=full's `trainable` must compile as a regex (lora mode does not read it)."""
  if cfg.mode != "full" or not cfg.trainable:
    return
  try:
    re.compile(cfg.trainable)
  except re.error as e:
    raise ConfigError(f"trainable: {cfg.trainable!r} is not a valid regex ({e})") from None


def check_data_sources(d) -> None:
  """`data.path` and `data.mix` name the training data two ways: one of them, not both."""
  if d.mix is not None and d.path is not None:
    raise ConfigError(f"data.mix and data.path are both set (data.path={d.path}): give the training data one way; "
                      "data.path=null clears it")
  if d.mix is not None and not d.mix:
    raise ConfigError("data.mix is empty: give at least one PATH=WEIGHT, or data.mix=null")


def _check_batching(d) -> None:
  """Batching settings the data pipeline cannot build batches from."""
  if d.tokens_per_batch is not None and d.batching == "dynamic":
    raise ConfigError("data.tokens_per_batch needs a fixed width per batch: use data.batching static, bucketed, "
                      "packed, bucketed_packed or auto with it, or unset data.tokens_per_batch")
  if d.batching in ("bucketed", "bucketed_packed") and d.bucket_lengths and max(d.bucket_lengths) < d.max_length:
    raise ConfigError(f"data.bucket_lengths: the largest bucket ({max(d.bucket_lengths)}) must be >= data.max_length "
                      f"({d.max_length}): examples are truncated to max_length, not to the largest bucket")
