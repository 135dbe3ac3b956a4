"""mode=full: the model's own weights are trained (all, or the ones `trainable` matches) with the
same step, checkpoints and resume; the run writes the whole tuned model as an HF folder that
jaxsft (and chat/export) load. Tiny random Llama; the first run with torch hidden (see
test_train.run_cli), the others in-process."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from test_train import base_args, read_metrics, run_cli


def weights(folder):
  return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_full_fine_tuning_trains_every_weight_and_writes_an_hf_model(tiny_dir, small_data, tmp_path, train_main):
  out = tmp_path / "full"
  r = run_cli(base_args(tiny_dir, small_data, out, "--mode", "full", "--lr", "1e-3", "max_steps=6",
                        "save_every=3", "eval.eval_every=3", "eval.num_prompts=2", "eval.max_new_tokens=2"))
  assert r.returncode == 0, r.stdout + r.stderr
  assert "trainable model params" in r.stderr and "python -m jaxsft.chat" in r.stdout  # the summary is on stdout
  assert "PyTorch was not found" not in r.stderr  # torch is hidden: transformers' advice is silenced
  train, val, _ = read_metrics(out)
  assert [l["step"] for l in train] == list(range(1, 7)) and val[-1]["val_loss"] < val[0]["val_loss"]
  assert not (out / "adapter").exists() and (out / "model" / "config.json").is_file()
  base, tuned = weights(tiny_dir), weights(out / "model")
  assert sorted(base) == sorted(tuned)
  changed = {k for k in base if not np.array_equal(base[k], tuned[k])}
  assert changed == set(base)  # every tensor moved (embedding, norms, all projections)
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 6 and "task_score_tuned" in summary

  # --resume from the last checkpoint continues with the full params and optimizer state.
  resumed = train_main(base_args(tiny_dir, small_data, out, "--mode", "full", "--lr", "1e-3", "max_steps=8",
                                 "save_every=3", "eval.eval_every=3", "eval.generate=false", "--resume"))
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert "resumed from step 6" in resumed.stderr
  assert [l["step"] for l in read_metrics(out)[0]] == list(range(1, 9))


@pytest.mark.slow
def test_trainable_regex_trains_only_the_matching_params(tiny_dir, small_data, tmp_path, train_main):
  out = tmp_path / "norms"
  r = train_main(base_args(tiny_dir, small_data, out, "--mode", "full", "--trainable", r"layernorm|^norm",
                           "max_steps=2", "save_every=0", "eval.eval_every=0", "eval.generate=false"))
  assert r.returncode == 0, r.stdout + r.stderr
  base, tuned = weights(tiny_dir), weights(out / "model")
  changed = {k for k in base if not np.array_equal(base[k], tuned[k])}
  assert changed and all("norm" in k for k in changed)
  assert "model.layers.0.self_attn.q_proj.weight" not in changed and "model.embed_tokens.weight" not in changed

  bad = train_main(base_args(tiny_dir, small_data, tmp_path / "none", "--mode", "full", "--trainable", "nothing_matches"))
  assert bad.returncode == 2 and "matches no parameter" in bad.stderr
  assert not (tmp_path / "none").exists()
