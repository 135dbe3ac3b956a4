"""`python -m jaxsft.export`: the merged model reloads to the same logits (HF folder, sharded,
GGUF in float32, float16, bfloat16 and q8_0), and bad inputs exit 2 writing nothing."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsft import export, models
from jaxsft.models import loading
from tuned_tiny import TINY_CHAT, make_adapter, make_model_dir, make_run_dir, tuned_model, without_torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
IDS = jnp.asarray([[1, 5, 900, 33, 2, 17, 400, 12000, 49151]], jnp.int32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
  root = tmp_path_factory.mktemp("export")
  model_dir = make_model_dir(root / "base", tokenizer)
  adapter = make_adapter(model_dir, root / "adapter")
  model, _ = tuned_model(model_dir, adapter)
  base, _ = models.load_model(str(model_dir))
  with jax.default_matmul_precision("highest"):
    want, base_logits = np.asarray(model(IDS)), np.asarray(base(IDS))
  assert np.abs(want - base_logits).max() > 1e-2  # the adapter matters
  return {"root": root, "model": model_dir, "adapter": adapter, "logits": want}


def logits_of(path):
  model, _ = models.load_model(str(path))
  with jax.default_matmul_precision("highest"):
    return np.asarray(model(IDS))


def test_hf_export_reloads_to_the_tuned_logits(tiny, tokenizer):
  out = export.export(str(tiny["model"]), str(tiny["adapter"]), tiny["root"] / "hf")
  names = sorted(p.name for p in out.iterdir())
  assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json"} <= set(names)
  assert not any(n.startswith(".") for n in os.listdir(tiny["root"]))  # no temp folder left behind
  np.testing.assert_allclose(logits_of(out), tiny["logits"], atol=1e-5)
  gen = json.loads((out / "generation_config.json").read_text())
  assert gen["eos_token_id"] == 2 and gen["do_sample"] is False
  from transformers import AutoTokenizer

  exported = AutoTokenizer.from_pretrained(str(out))
  messages = [{"role": "user", "content": "Hi"}]
  assert exported.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages, tokenize=False)


def test_hf_export_shards_past_the_size_limit(tiny):
  out = export.export(str(tiny["model"]), str(tiny["adapter"]), tiny["root"] / "sharded", max_shard_size="4MB")
  index = json.loads((out / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) >= 2 and all((out / s).is_file() for s in shards) and not (out / "model.safetensors").exists()
  np.testing.assert_allclose(logits_of(out), tiny["logits"], atol=1e-5)


@pytest.mark.parametrize("fmt,dtype,atol", [("hf", "bfloat16", 0.05), ("hf", "float16", 5e-3),
                                            ("gguf", "float32", 1e-5), ("gguf", "float16", 5e-3),
                                            ("gguf", "bfloat16", 0.05), ("gguf", "q8_0", 0.1)])
def test_other_dtypes_round_trip_within_their_rounding(tiny, fmt, dtype, atol):
  out = export.export(str(tiny["model"]), str(tiny["adapter"]), tiny["root"] / f"{fmt}-{dtype}", fmt=fmt, dtype=dtype)
  path = out / "model.gguf" if fmt == "gguf" else out
  got = logits_of(path)
  err = np.abs(got - tiny["logits"]).max()
  assert err < atol, err
  assert (np.argmax(got, -1) == np.argmax(tiny["logits"], -1)).mean() >= 0.75


def test_gguf_export_is_in_llama_cpp_layout(tiny):
  """The gguf reader sees llama.cpp's names, the q/k row permutation, metadata and tokenizer."""
  from gguf import GGUFReader

  out = export.export(str(tiny["model"]), str(tiny["adapter"]), tiny["root"] / "gguf-layout", fmt="gguf")
  reader = GGUFReader(str(out / "model.gguf"))
  field = lambda k: reader.fields[k].contents()
  assert field("general.architecture") == "llama" and field("llama.block_count") == TINY_CHAT.num_layers
  assert field("llama.attention.head_count_kv") == TINY_CHAT.num_kv_heads
  assert "im_start" in field("tokenizer.chat_template") and field("tokenizer.ggml.eos_token_id") == 2
  assert len(field("tokenizer.ggml.tokens")) == 49152
  tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
  assert "output.weight" in tensors and "blk.1.ffn_down.weight" in tensors
  merged = export.merged_state_dict(tuned_model(tiny["model"], tiny["adapter"])[0])
  q = merged["model.layers.0.self_attn.q_proj.weight"]
  np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"], export.permute_qk(q, TINY_CHAT.num_heads))
  assert not np.array_equal(tensors["blk.0.attn_q.weight"], q)  # the permutation is not the identity
  np.testing.assert_array_equal(loading.unpermute_qk(export.permute_qk(q, 4), 4), q)


@pytest.mark.slow
def test_real_smollm2_gguf_export_keeps_the_tokenizer_and_logits(tmp_path):
  """From the shipped GGUF: tokenizer metadata copied over, weights reload to the same logits."""
  out = export.export("smollm2-135m-instruct", None, tmp_path / "gguf", fmt="gguf", dtype="float32")
  base, tok = models.load_model("smollm2-135m-instruct")
  again, tok2 = models.load_model(str(out / "model.gguf"))
  text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False)
  assert tok2.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False) == text
  ids = jnp.asarray([tok(text)["input_ids"]], jnp.int32)
  np.testing.assert_allclose(np.asarray(again(ids)), np.asarray(base(ids)), atol=1e-4)


# ---------------------------------------------------------------------------------------------
# The command line and its bad inputs.


def cli(*args):
  env = dict(os.environ, HF_HUB_OFFLINE="1")
  return subprocess.run([*without_torch("jaxsft.export"), *map(str, args)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_cli_exports_a_run_dir_and_refuses_an_existing_out(tiny, tmp_path):
  run = make_run_dir(tmp_path / "run", tiny["model"], tiny["adapter"])
  r = cli(run, "--out", tmp_path / "out")
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1].startswith("wrote") and len(r.stderr.strip().splitlines()) == 1  # quiet
  np.testing.assert_allclose(logits_of(tmp_path / "out"), tiny["logits"], atol=1e-5)
  before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
  r = cli(run, "--out", tmp_path / "out", "--format", "gguf")
  assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr
  assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before
  r = cli(run, "--out", tmp_path / "out", "--format", "gguf", "--overwrite")
  assert r.returncode == 0, r.stderr[-2000:]
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.gguf"]


def test_cli_bad_inputs_exit_2_and_write_nothing(tiny, tmp_path, tokenizer):
  other = make_model_dir(tmp_path / "other", tokenizer,
                         config=__import__("dataclasses").replace(TINY_CHAT, hidden_size=32, head_dim=8))
  cases = {
      "no adapter": (["--model", tiny["model"], "--adapter", tmp_path / "nowhere"], "adapter_config.json is missing"),
      "wrong base": (["--model", other, "--adapter", tiny["adapter"]], "does not fit model"),
      "not a run": ([tmp_path / "empty"], "not a jaxsft run directory"),
      "q8_0 for hf": (["--model", tiny["model"], "--dtype", "q8_0"], "not available for --format hf"),
  }
  (tmp_path / "empty").mkdir()
  for name, (args, message) in cases.items():
    out = tmp_path / f"out-{name.replace(' ', '-')}"
    r = cli(*args, "--out", out)
    assert r.returncode == 2, (name, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last, (name, last)
    assert not out.exists(), name
  assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "other"]
