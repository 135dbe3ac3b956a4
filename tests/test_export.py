"""`python -m jaxsft.export`: the merged model reloads to the same logits (HF folder, sharded,
GGUF in float32, float16, bfloat16 and q8_0), and bad inputs exit 2 writing nothing. GGUF of
Qwen3, Gemma 3, SmolLM3, Phi-3 and OLMo 2: the round trip through jaxsft, llama.cpp's layout, and
the models and files llama.cpp would run differently, refused."""

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
from jaxsft.models.gguf import gguf_config, gguf_refusal, read_gguf
from jaxsft.models.gguf.llama_cpp import permute_qk, unpermute_qk
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_base_without_a_chat_template_exports_the_template_it_trained_with(tiny, tokenizer):
  """Its records were rendered with jaxsft's plain template: the HF folder and the GGUF carry it."""
  from gguf import GGUFReader
  from transformers import AutoTokenizer

  from jaxsft.data import PLAIN_CHAT_TEMPLATE
  from jaxsft.data.template import render_chat

  base = tiny["root"] / "no_template"
  make_model_dir(base, tokenizer)
  (base / "chat_template.jinja").unlink(missing_ok=True)
  config = json.loads((base / "tokenizer_config.json").read_text())
  (base / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
  trained_with = models.load_tokenizer(str(base))
  assert not trained_with.chat_template
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello"}]
  hf = AutoTokenizer.from_pretrained(str(export.export(str(base), None, tiny["root"] / "no_template_hf")))
  assert hf.chat_template == PLAIN_CHAT_TEMPLATE
  assert hf.apply_chat_template(messages, tokenize=False) == render_chat(trained_with, messages)
  reader = GGUFReader(str(export.export(str(base), None, tiny["root"] / "no_template_gguf", fmt="gguf") / "model.gguf"))
  assert reader.fields["tokenizer.chat_template"].contents() == PLAIN_CHAT_TEMPLATE


def test_hf_export_shards_past_the_size_limit(tiny):
  out = export.export(str(tiny["model"]), str(tiny["adapter"]), tiny["root"] / "sharded", max_shard_size="4MB")
  index = json.loads((out / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) >= 2 and all((out / s).is_file() for s in shards) and not (out / "model.safetensors").exists()
  np.testing.assert_allclose(logits_of(out), tiny["logits"], atol=1e-5)


@pytest.mark.parametrize("fmt,dtype,atol", [("hf", "bfloat16", 0.05), ("hf", "float16", 5e-3),
                                            ("gguf", "float32", 1e-5), ("gguf", "float16", 5e-3),
                                            ("gguf", "bfloat16", 0.05), ("gguf", "q8_0", 0.1)])
@pytest.mark.slow
def test_other_dtypes_round_trip_within_their_rounding(tiny, fmt, dtype, atol):
  out = export.export(str(tiny["model"]), str(tiny["adapter"]), tiny["root"] / f"{fmt}-{dtype}", fmt=fmt, dtype=dtype)
  path = out / "model.gguf" if fmt == "gguf" else out
  got = logits_of(path)
  err = np.abs(got - tiny["logits"]).max()
  assert err < atol, err
  assert (np.argmax(got, -1) == np.argmax(tiny["logits"], -1)).mean() >= 0.75


@pytest.mark.slow
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
  np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"], permute_qk(q, TINY_CHAT.num_heads))
  assert not np.array_equal(tensors["blk.0.attn_q.weight"], q)  # the permutation is not the identity
  np.testing.assert_array_equal(unpermute_qk(permute_qk(q, 4), 4), q)


@pytest.mark.slow
def test_real_smollm2_gguf_export_keeps_the_tokenizer_and_logits(tmp_path, smollm2_jax, tokenizer):
  """From the shipped GGUF: tokenizer metadata copied over, weights reload to the same logits."""
  out = export.export("smollm2-135m-instruct", None, tmp_path / "gguf", fmt="gguf", dtype="float32")
  base, tok = smollm2_jax, tokenizer  # the session's float32 load of the shipped model
  again, tok2 = models.load_model(str(out / "model.gguf"))
  text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False)
  assert tok2.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False) == text
  ids = jnp.asarray([tok(text)["input_ids"]], jnp.int32)
  np.testing.assert_allclose(np.asarray(again(ids)), np.asarray(base(ids)), atol=1e-4)


# ---------------------------------------------------------------------------------------------
# The command line and its bad inputs.


def cli(*args):
  """`python -m jaxsft.export ARGS` with torch hidden, as a user runs it."""
  env = dict(os.environ, HF_HUB_OFFLINE="1")
  for key in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY"):  # set by jaxsft imported here
    env.pop(key, None)
  return subprocess.run([*without_torch("jaxsft.export"), *map(str, args)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_exports_a_run_dir_and_refuses_an_existing_out(tiny, tmp_path, run_cli):
  run = make_run_dir(tmp_path / "run", tiny["model"], tiny["adapter"])
  r = cli(run, "--out", tmp_path / "out")
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1].startswith("wrote") and len(r.stderr.strip().splitlines()) == 1  # quiet
  np.testing.assert_allclose(logits_of(tmp_path / "out"), tiny["logits"], atol=1e-5)
  before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
  r = run_cli(export.main, [run, "--out", tmp_path / "out", "--format", "gguf"])  # in-process from here on
  assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr
  assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before
  r = run_cli(export.main, [run, "--out", tmp_path / "out", "--format", "gguf", "--overwrite"])
  assert r.returncode == 0, r.stderr[-2000:]
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.gguf"]


def test_cli_bad_inputs_exit_2_and_write_nothing(tiny, tmp_path, tokenizer, run_cli):
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
    r = run_cli(export.main, [*args, "--out", out])
    assert r.returncode == 2, (name, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last, (name, last)
    assert not out.exists(), name
  assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "other"]


# ---------------------------------------------------------------------------------------------
# GGUF of the other families, in llama.cpp's conventions (jaxsft.models.gguf.gguf_refusal says
# which settings llama.cpp fixes without a key; those variants are refused below).

L6 = ["sliding_attention"] * 5 + ["full_attention"]
# The tiny family configs of tiny_model.FAMILY_CONFIGS, changed only where llama.cpp has no key
# for the setting: Qwen3 without sliding layers; Gemma 3 with llama.cpp's period-6 pattern (six
# layers: five sliding, one full) and query_pre_attn_scalar = head_dim; SmolLM3 with its real NoPE
# layers (every 4th). Phi-3 (partial rotary, one window) and OLMo 2 are written as they are.
GGUF_FAMILIES = {
    "qwen3": {"use_sliding_window": False, "sliding_window": None, "layer_types": None},
    "gemma3_text": {"num_hidden_layers": 6, "layer_types": L6, "query_pre_attn_scalar": 16},
    "smollm3": {"no_rope_layers": [1, 1, 1, 0]},
    "phi3": {}, "olmo2": {},
}
GGUF_ARCH = {"qwen3": "qwen3", "gemma3_text": "gemma3", "smollm3": "smollm3", "phi3": "phi3", "olmo2": "olmo2"}
LONG_IDS = jnp.asarray(np.random.default_rng(3).integers(0, 49152, (1, 70)), jnp.int32)  # past every window


def gguf_family_config(kind, **changes):
  from tiny_model import family_config

  hf = models.to_hf_config(family_config(kind))
  hf.update({**GGUF_FAMILIES[kind], **changes})
  return models.from_hf_config(hf)


def write_family_dir(path, tokenizer, config, seed=0):
  """A random model of `config` as an HF folder, norms (and biases) random so each one shows."""
  from safetensors.numpy import save_file

  path.mkdir(parents=True)
  rng = np.random.default_rng(seed)
  tensors = {}
  for name, value in models.to_hf_state_dict(models.init_random(config, seed=seed)).items():
    value = np.array(value, np.float32)
    tensors[name] = rng.uniform(0.5, 1.5, value.shape).astype(np.float32) if value.ndim == 1 else value
  save_file(tensors, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(models.to_hf_config(config)))
  tokenizer.save_pretrained(str(path))
  return path, tensors


@pytest.fixture(scope="module", params=sorted(GGUF_FAMILIES))
def family_gguf(request, tmp_path_factory, tokenizer):
  kind = request.param
  root = tmp_path_factory.mktemp(f"gguf-{kind}")
  folder, tensors = write_family_dir(root / "hf", tokenizer, gguf_family_config(kind))
  out = export.export(str(folder), None, root / "gguf", fmt="gguf")
  return kind, folder, tensors, out / "model.gguf"


@pytest.mark.slow
def test_family_gguf_reloads_to_the_same_config_and_logits(family_gguf):
  """jaxsft model -> GGUF -> load_causal_lm: the same LlamaConfig and bit-identical float32
  logits (Gemma 3's norms are stored as 1 + w; w may lose its last bit, 1 + w does not)."""
  kind, folder, _, gguf_path = family_gguf
  base = models.load_causal_lm(str(folder))
  again = models.load_causal_lm(str(gguf_path))
  assert again.config == base.config and again.config.model_type == kind
  with jax.default_matmul_precision("highest"):
    np.testing.assert_array_equal(np.asarray(again(LONG_IDS)), np.asarray(base(LONG_IDS)))


@pytest.mark.slow
def test_family_gguf_is_in_llama_cpp_layout(family_gguf):
  """Names as the gguf package's TensorNameMap gives them for the arch, q/k rows permuted only
  for smollm3 (llama.cpp's LlamaModel converter), norms + 1 only for gemma3, the keys llama.cpp
  reads for the family."""
  import gguf
  from gguf import GGUFReader

  kind, _, tensors, gguf_path = family_gguf
  arch = GGUF_ARCH[kind]
  config = gguf_family_config(kind)
  reader = GGUFReader(str(gguf_path))
  field = lambda k: reader.fields[k].contents() if k in reader.fields else None
  assert field("general.architecture") == arch
  stored = {t.name: np.asarray(t.data) for t in reader.tensors}
  name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_layers)
  expected = {}
  for hf_name, value in tensors.items():
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
      continue
    stem, leaf = hf_name.rsplit(".", 1)
    expected[f"{name_map.get_name(stem)}.{leaf}"] = value
  assert sorted(stored) == sorted(expected)
  q = tensors["model.layers.0.self_attn.q_proj.weight" if kind != "phi3" else "model.layers.0.self_attn.qkv_proj.weight"]
  stored_q = stored["blk.0.attn_q.weight" if kind != "phi3" else "blk.0.attn_qkv.weight"]
  if kind == "smollm3":
    np.testing.assert_array_equal(stored_q, permute_qk(q, config.num_heads))
  else:
    np.testing.assert_array_equal(stored_q, q)
  for gguf_name, value in expected.items():
    if gguf_name.endswith("norm.weight"):
      np.testing.assert_array_equal(stored[gguf_name], value + np.float32(kind == "gemma3_text"), err_msg=gguf_name)
  assert field(f"{arch}.attention.key_length") == config.head_dim
  assert field(f"{arch}.rope.dimension_count") == (config.head_dim // 2 if kind == "phi3" else config.head_dim)
  window = {"gemma3_text": 24, "phi3": 48}.get(kind)
  assert field(f"{arch}.attention.sliding_window") == window
  if kind == "gemma3_text":
    assert field("gemma3.rope.scaling.type") == "linear" and field("gemma3.rope.scaling.factor") == 8.0
    assert field("gemma3.rope.freq_base") == 1e6 and field("gemma3.rope.freq_base_swa") == 1e4


@pytest.mark.parametrize("kind,changes,reason", [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 2, "layer_types": None},
     "sliding-window attention \\(window 24\\): jaxsft writes qwen3 without one"),
    ("gemma3_text", {"num_hidden_layers": 4, "layer_types": L6[4:] * 2},  # sliding, full, sliding, full
     "slides exactly the layers i with i % 6 < 5 .*this model slides \\[0, 2\\] of 4"),
    ("gemma3_text", {"query_pre_attn_scalar": 24}, "scales attention by 1/sqrt\\(16\\)"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}},
     "sliding layers' RoPE base at 10000; this model's is 50000"),
    ("smollm3", {"no_rope_layers": [1, 0, 1, 0]}, "leaves RoPE out of exactly the layers i with \\(i \\+ 1\\) % 4 == 0"),
    ("smollm3", {"no_rope_layers": [1, 1, 1, 1]}, "this model leaves it out of \\[\\]"),
    ("olmo2", {"sliding_window": 16}, "jaxsft writes olmo2 without one"),
    ("phi3", {"attention_bias": True}, "jaxsft writes phi3 without bias tensors"),
])
def test_gguf_export_refuses_what_llama_cpp_would_run_differently(kind, changes, reason):
  config = gguf_family_config(kind, **changes)
  with pytest.raises(export.ExportError, match=f"cannot express this {kind} model: .*{reason}"):
    export.check_gguf(config)


def test_gguf_export_of_the_tiny_family_models_refuses_them_writing_nothing(tmp_path, tokenizer):
  """The tiny Qwen3 (sliding layers), Gemma 3 (period-2 pattern, query_pre_attn_scalar 24) and
  SmolLM3 (NoPE on layers 1 and 3) have settings llama.cpp fixes otherwise: refused, no --out."""
  from tiny_model import family_config

  for kind in ("qwen3", "gemma3_text", "smollm3"):
    folder, _ = write_family_dir(tmp_path / kind, tokenizer, family_config(kind))
    with pytest.raises(export.ExportError, match=f"GGUF export cannot express this {kind} model"):
      export.export(str(folder), None, tmp_path / f"{kind}-gguf", fmt="gguf")
    assert not (tmp_path / f"{kind}-gguf").exists()
  assert gguf_refusal(family_config("phi3")) is None and gguf_refusal(family_config("olmo2")) is None


def metadata_gguf(path, arch, *edits, tensors=("token_embd.weight",)):
  """A GGUF file of `arch` with the usual tiny metadata, then `edits` (writer method, value...)."""
  import gguf

  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(6)
  writer.add_embedding_length(64)
  writer.add_feed_forward_length(96)
  writer.add_head_count(4)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_vocab_size(8)
  for method, *args in edits:
    getattr(writer, method)(*args)
  for name in tensors:
    writer.add_tensor(name, np.zeros((8, 64) if name == "token_embd.weight" else (16,), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_gguf_reading_refuses_files_it_cannot_read_faithfully(tmp_path):
  import gguf

  window = ("add_sliding_window", 16)
  cases = {
      "olmo3": ("olmo2", [window], (), "olmo2.attention.sliding_window = 16: .*OLMo 3"),
      "gemma3 without window": ("gemma3", [], (), "gemma3.attention.sliding_window = None"),
      "gemma3 period 2": ("gemma3", [window, ("add_sliding_window_pattern", 2)], (),
                          "gemma3.attention.sliding_window_pattern = 2: llama.cpp's gemma3 fixes the pattern"),
      "gemma3 local base": ("gemma3", [window, ("add_rope_freq_base_swa", 1e6)], (), "gemma3.rope.freq_base_swa"),
      "softcapping": ("gemma3", [window, ("add_final_logit_softcapping", 30.0)], (), "final_logit_softcapping"),
      "yarn": ("phi3", [("add_rope_scaling_type", gguf.RopeScalingType.YARN)], (), "phi3.rope.scaling.type = 'yarn'"),
      "longrope": ("phi3", [], ("token_embd.weight", "rope_factors_long.weight"), "Phi-3 LongRoPE"),
      "biases": ("qwen3", [], ("token_embd.weight", "blk.0.attn_q.bias"), "qwen3 with bias tensors"),
      "partial rotary": ("qwen3", [("add_rope_dimension_count", 8)], (), "qwen3.rope.dimension_count = 8"),
      "arch": ("gemma2", [], (), "unsupported GGUF architecture 'gemma2'"),
  }
  for name, (arch, edits, tensors, message) in cases.items():
    path = metadata_gguf(tmp_path / f"{name}.gguf", arch, *edits, tensors=tensors or ("token_embd.weight",))
    with pytest.raises(ValueError, match=message):
      read_gguf(path)
  # the keys a newer converter adds are read when they agree with what llama.cpp fixes
  path = metadata_gguf(tmp_path / "gemma3.gguf", "gemma3", window, ("add_sliding_window_pattern", 6),
                       ("add_rope_freq_base_swa", 1e4), ("add_key_length", 16))
  from gguf import GGUFReader

  config = models.from_hf_config(gguf_config(GGUFReader(str(path)), str(path)))
  assert config.layer_windows() == (16,) * 5 + (None,) and config.rope_local_theta == 1e4
  assert config.query_pre_attn_scalar == 16 and config.norm_unit_offset
