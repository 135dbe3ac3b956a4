"""The non-Llama families without torch: HF folders round-trip, one scanned layer per model,
refusals that name the architecture, and a CLI run (train, then chat) on a tiny Phi-3."""

import json

import jax
import numpy as np
import pytest

from jaxsft import lora, models
from tiny_model import FAMILY_CONFIGS, family_config, make_family_model_dir


@pytest.mark.parametrize("kind", sorted(FAMILY_CONFIGS))
def test_hf_folder_round_trips_config_weights_and_logits(kind, tokenizer, tmp_path):
  folder = make_family_model_dir(tmp_path / kind, tokenizer, kind, seed=1)
  model = models.load_causal_lm(str(folder))
  assert model.config == family_config(kind)
  saved = json.loads((folder / "config.json").read_text())
  assert models.from_hf_config(saved) == model.config
  from safetensors.numpy import load_file

  tensors = load_file(str(folder / "model.safetensors"))
  again = models.to_hf_state_dict(model)
  assert sorted(again) == sorted(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(again[name], value, err_msg=name)
  ids = np.asarray([tokenizer("a river of stones and clouds, " * 12)["input_ids"][:64]])
  logits = np.asarray(model(ids))
  assert logits.shape == (1, 64, 49152) and np.all(np.isfinite(logits))


@pytest.mark.parametrize("kind", sorted(FAMILY_CONFIGS))
def test_layer_stack_stays_one_scan_whatever_differs_between_layers(kind):
  """Per-layer windows and RoPE kinds are scanned indices, not unrolled layers: the jaxpr holds
  one scan over all layers, whose body has one attention."""
  config = family_config(kind)
  model = models.init_random(config)
  jaxpr = jax.make_jaxpr(lambda ids: model(ids))(np.zeros((1, 32), np.int32))
  scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert len(scans) == 1 and scans[0].params["length"] == config.num_layers
  body = str(scans[0].params["jaxpr"])
  assert body.count("exp") >= 1  # the softmax of the one attention


def test_phi3_module_names_and_all_linear():
  model = models.init_random(family_config("phi3"))
  assert tuple(lora.module_paths(model)) == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
  lora.apply_lora(model, r=2, target_modules="all-linear")
  assert model.lora_settings.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
  with pytest.raises(ValueError, match=r"q_proj.*qkv_proj"):
    lora.apply_lora(model, r=2, target_modules=("q_proj", "v_proj"))


def test_a_config_of_another_architecture_lists_what_is_supported(tmp_path):
  folder = tmp_path / "gpt2"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
  (folder / "model.safetensors").write_bytes(b"")
  with pytest.raises(ValueError) as e:
    models.load_causal_lm(str(folder))
  message = str(e.value)
  assert "gpt2" in message
  for arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "SmolLM3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM"):
    assert arch in message


@pytest.mark.slow
def test_train_then_chat_on_a_tiny_phi3(tokenizer, tmp_path, train_main, run_cli):
  """The CLI on a family with fused projections: the adapter is saved under PEFT's fused names
  and chat loads base + adapter back (both commands' `main` in-process)."""
  from jaxsft import chat as chat_lib
  from jaxsft.data import synthetic

  model_dir = make_family_model_dir(tmp_path / "phi3", tokenizer, "phi3")
  data = synthetic.write_jsonl(synthetic.make_dataset(40, seed=2), tmp_path / "tasks.jsonl")
  out = tmp_path / "run"
  train = train_main(["--model", model_dir, "--data", data, "--output-dir", out, "max_steps=3", "data.num_buckets=1",
                       "data.batch_size=8", "data.tokens_per_batch=none", "data.max_val_examples=8",
                       "eval.num_prompts=2", "eval.max_new_tokens=4", "data.time_shapes=false", "--no-progress"])
  assert train.returncode == 0, train.stdout + train.stderr
  adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
  assert adapter["target_modules"] == sorted(["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
  from safetensors.numpy import load_file

  names = load_file(str(out / "adapter" / "adapter_model.safetensors"))
  assert "base_model.model.model.layers.3.self_attn.qkv_proj.lora_A.weight" in names
  chat = run_cli(chat_lib.main, [out, "--prompt", "Hi", "--max-new-tokens", "4"])
  assert chat.returncode == 0, chat.stdout + chat.stderr
  assert chat.stdout.strip()
