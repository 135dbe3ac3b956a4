"""Fixtures for the PyTorch cross-check suite: the same weights and batches on both sides.

Everything runs in float32, jaxsft under `jax.default_matmul_precision("highest")`. The real
SmolLM2-135M-Instruct is loaded once per session on each side (transformers from the GGUF, converted
once for all the session's processes; jaxsft from its safetensors cache of the same GGUF); the tiny
random Llama (Llama-3 rope scaling, untied) and Qwen2 (q/k/v biases, tied) are built with
transformers and loaded by jaxsft from the saved directory. Batches are real examples of
`../shared/data/` through `jaxsft.data`.
"""

from __future__ import annotations

import os
import pathlib

import filelock
import jax
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from jaxsft import data  # noqa: E402
from jaxsft.models import load_causal_lm, resolve_model  # noqa: E402

from parity_utils import PAD  # noqa: E402
import worker_threads  # noqa: E402  tests/worker_threads.py


def pytest_collection_modifyitems(items):
  for item in items:
    if "torch_parity" in str(item.fspath):
      item.add_marker(pytest.mark.torch)


@pytest.fixture(autouse=True)
def highest_precision():
  torch.set_num_threads(worker_threads.torch_threads())
  with jax.default_matmul_precision("highest"):
    yield


# ---------------------------------------------------------------------------------------------
# Batches


@pytest.fixture(scope="session")
def examples(tokenizer, shared_data):
  """Tokenized Alpaca examples (≤ 128 tokens, at least one trained token), in file order."""
  records = data.load_records(shared_data / "alpaca_en_demo.json")
  out = []
  for record in records[:64]:
    example = data.tokenize_example(tokenizer, record, max_length=128)
    if example is not None:
      out.append(example)
  return out


@pytest.fixture(scope="session")
def multiturn_examples(tokenizer, shared_data):
  records = data.load_records(shared_data / "chat_multiturn_demo.json")
  out = []
  for record in records:
    if len(record["messages"]) > 2:
      example = data.tokenize_example(tokenizer, record, max_length=128)
      if example is not None:
        out.append(example)
    if len(out) == 4:
      return out
  raise AssertionError("no multi-turn examples")


# ---------------------------------------------------------------------------------------------
# Models


def _smollm2_safetensors_folder() -> pathlib.Path:
  """The real SmolLM2 as transformers reads it from the GGUF, saved once per session as a
  safetensors folder: reading the GGUF takes transformers seconds, the folder a fraction of one.
  The session's test processes share the folder (JAXSFT_CACHE, conftest.py); the first to need it
  converts, under a lock, and the others wait for it."""
  folder = pathlib.Path(os.environ["JAXSFT_CACHE"]) / "torch-smollm2-135m-instruct"
  with filelock.FileLock(f"{folder}.lock"):
    if not (folder / "model.safetensors").is_file():
      source = resolve_model("smollm2-135m-instruct")
      model = transformers.AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                                dtype=torch.float32)
      # The weights are dequantized float32 already; what marks them "GGUF" only blocks saving.
      model.hf_quantizer, model.config.quantization_config = None, None
      partial = folder.with_name(folder.name + ".partial")
      model.save_pretrained(partial)
      partial.rename(folder)
  return folder


@pytest.fixture(scope="session")
def smollm2_torch():
  model = transformers.AutoModelForCausalLM.from_pretrained(_smollm2_safetensors_folder(), dtype=torch.float32)
  return model.eval()


def tiny_hf_config(kind: str):
  common = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
  if kind == "llama":
    return transformers.LlamaConfig(
        **common, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
  if kind == "qwen2":
    return transformers.Qwen2Config(**common, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  return family_hf_config(kind, common)


# Tiny configs of the other families, each with several layers so that every layer kind of the
# family appears (sliding and full, RoPE and NoPE), windows short enough to cut into 128-token
# rows, and the family's own switches off their defaults where a default would hide a bug
# (head_dim != hidden / heads, query_pre_attn_scalar != head_dim, partial rotary).
FAMILIES = ("mistral", "qwen3", "gemma3_text", "smollm3", "phi3", "olmo2")


def family_hf_config(kind: str, common: dict):
  common = dict(common, num_hidden_layers=4)
  if kind == "mistral":
    return transformers.MistralConfig(**common, sliding_window=24, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
  if kind == "qwen3":
    return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, use_sliding_window=True,
                                    sliding_window=24, max_window_layers=2,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  if kind == "gemma3_text":
    return transformers.Gemma3TextConfig(
        **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
  if kind == "smollm3":
    return transformers.SmolLM3Config(**common, no_rope_layers=[1, 0, 1, 0],
                                      rope_parameters={"rope_type": "default", "rope_theta": 2e6})
  if kind == "phi3":
    return transformers.Phi3Config(**common, sliding_window=48,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5})
  if kind == "olmo2":
    return transformers.Olmo2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
  raise ValueError(kind)


def _tiny_pair(kind, tmp_path_factory):
  """(torch model, jaxsft model) with the same random weights, through a saved HF directory."""
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(kind), dtype=torch.float32)
  with torch.no_grad():  # nonzero biases and non-unit norm weights, so that loading them is checked
    for name, p in hf.named_parameters():
      if p.ndim == 1:
        p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
  folder = tmp_path_factory.mktemp(f"tiny_{kind}")
  hf.save_pretrained(folder)
  return hf.eval(), load_causal_lm(str(folder), dtype="float32")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
  return _tiny_pair("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
  return _tiny_pair("qwen2", tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2(smollm2_torch, smollm2_jax):
  return smollm2_torch, smollm2_jax


MODELS = [pytest.param("smollm2", marks=pytest.mark.slow), "tiny_llama", "tiny_qwen2"]


@pytest.fixture(params=MODELS)
def pair(request):
  """(torch model, jaxsft model): the real SmolLM2 (slow) and the tiny Llama and Qwen2."""
  return request.getfixturevalue(request.param)


