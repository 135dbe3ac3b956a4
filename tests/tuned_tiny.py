"""A tiny random Llama directory plus a random (nonzero) LoRA adapter for it, for the chat and
export tests: the adapter changes the outputs, so a path that dropped it would be caught."""

import dataclasses
import json
import pathlib

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxsft import lora, models
from hide_torch import PRELUDE
from tiny_model import TINY

# Untied head (a tied random model just repeats its input) and a short window.
TINY_CHAT = dataclasses.replace(TINY, tie_word_embeddings=False, max_position_embeddings=256)


def make_model_dir(path, tokenizer, config=TINY_CHAT, seed: int = 0) -> pathlib.Path:
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  model = models.init_random(config, seed=seed)
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in models.to_hf_state_dict(model).items()},
            str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(models.to_hf_config(config), indent=2))
  tokenizer.save_pretrained(str(path))
  return path


def make_adapter(model_dir, out, *, r: int = 4, seed: int = 1, target_modules="all-linear") -> pathlib.Path:
  model, _ = models.load_model(str(model_dir))
  lora.apply_lora(model, r=r, alpha=2 * r, target_modules=target_modules, seed=seed)
  for i, name in enumerate(lora.resolve_target_modules(target_modules)):
    proj = lora._projection(model, name)
    proj.lora_b.set_value(0.2 * jax.random.normal(jax.random.key(seed * 100 + i), proj.lora_b.shape))
  return lora.save_adapter(model, out, base_model_name_or_path=str(model_dir))


def make_run_dir(path, model_dir, adapter_dir) -> pathlib.Path:
  """The files of a finished run that chat/export read: config.json and adapter/."""
  import shutil

  from jaxsft import config as config_lib

  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  cfg = config_lib.TrainConfig()
  cfg.model.name = str(model_dir)
  (path / "config.json").write_text(json.dumps(config_lib.to_dict(cfg), default=str))
  shutil.copytree(adapter_dir, path / "adapter")
  return path


def tuned_model(model_dir, adapter_dir):
  model, tokenizer = models.load_model(str(model_dir))
  lora.load_adapter(model, str(adapter_dir))
  return model, tokenizer


# `python -m <module> ARGS` in an interpreter where torch cannot be found (as in a runtime-only
# install): transformers then prints its "PyTorch was not found" advice unless jaxsft silences it.
_HIDE_TORCH = PRELUDE + """
import runpy
module = sys.argv.pop(1)
sys.argv[0] = module
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def without_torch(module: str) -> list[str]:
  """The argv prefix that runs `python -m module` with torch hidden."""
  import sys

  return [sys.executable, "-c", _HIDE_TORCH, module]
