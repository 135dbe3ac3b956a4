"""The trainer with DoRA and NEFTune on a tiny model: together they train, save a
peft DoRA adapter and resume exactly (the noise of a step follows from the seed and the step)."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from test_train import DETERMINISTIC, read_metrics

OPTIONS = ("lora.use_dora=true", "--neftune-noise-alpha", "5", "eval.eval_every=2")


def _args(tiny_dir, out, *extra):
  return ["--model", tiny_dir, "--output-dir", out, "data.synthetic_size=48", "data.batch_size=8", "data.num_buckets=1",
          "data.tokens_per_batch=none", "data.time_shapes=false", "eval.generate=false", "optim.schedule=constant",
          "optim.warmup_steps=0", "--lr", "1e-2", "--no-progress", "--model.dtype", "float32", "save_every=2",
          "data.max_val_examples=8", *OPTIONS, *extra]


@pytest.mark.slow
def test_dora_and_neftune_train_save_and_resume_exactly(tiny_dir, tmp_path, train_main):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  assert (r := train_main(_args(tiny_dir, straight, "max_steps=4"))).returncode == 0, r.stderr[-2000:]
  assert (r := train_main(_args(tiny_dir, resumed, "max_steps=2"))).returncode == 0, r.stderr[-2000:]
  assert (r := train_main(_args(tiny_dir, resumed, "max_steps=4", "--resume"))).returncode == 0, r.stderr[-2000:]
  train_a, val_a, _ = read_metrics(straight)
  train_b, val_b, _ = read_metrics(resumed)
  assert [l["step"] for l in train_b] == [1, 2, 3, 4]
  for a, b in zip(train_a, train_b):
    assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}, (a, b)
  assert [v["val_loss"] for v in val_a] == [v["val_loss"] for v in val_b]
  config = json.loads((straight / "adapter" / "adapter_config.json").read_text())
  assert config["use_dora"] is True
  tensors = load_file(str(straight / "adapter" / "adapter_model.safetensors"))
  magnitudes = {k: v for k, v in tensors.items() if k.endswith("lora_magnitude_vector")}
  assert len(magnitudes) == 7 * 2  # every projection (the embedded default: all-linear) of both layers
  # The magnitude trained: it left its initial value ‖W‖ (the base's column norms).
  base = load_file(str(tiny_dir / "model.safetensors"))
  q0 = base["model.layers.0.self_attn.q_proj.weight"]  # (out, in): the norm over the input dim
  trained = magnitudes["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"]
  assert np.abs(trained - np.linalg.norm(q0, axis=1)).max() > 1e-4


@pytest.mark.parametrize("argv, words", [
    (["--neftune-noise-alpha", "-1"], ["neftune_noise_alpha", ">= 0", "-1"]),
    (["neftune_noise_alpha=nan"], ["neftune_noise_alpha", "finite"]),
    (["lora.use_dora=maybe"], ["lora.use_dora", "'maybe'", "bool"]),
])
def test_a_bad_option_value_is_one_error_line_and_writes_nothing(argv, words, tmp_path, train_main):
  out = tmp_path / "never"
  r = train_main(["--output-dir", out, *argv])
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr
  for w in words:
    assert w in lines[0], (w, lines[0])
  assert not out.exists()
