"""Every family beyond Llama (Mistral, Qwen3, Gemma 3, SmolLM3, Phi-3, OLMo 2) against transformers + peft.

Each family is a tiny random model built by transformers from its own config class (4 layers, so
that sliding and full layers, RoPE and NoPE layers, all appear; see `conftest.family_hf_config`),
saved as a Hugging Face folder and loaded by jaxsft. Checked in float32 on real Alpaca and
multi-turn rows: logits (≤ 1e-4) and loss (≤ 1e-5) on padded and packed batches, padding and
bucket invariance, LoRA gradients on every linear layer (≤ 1e-4 relative, fused Phi-3
projections included), PEFT adapters both ways, and greedy generation for 16 tokens.
"""

import numpy as np
import pytest
import torch
import transformers
from conftest import FAMILIES, tiny_hf_config
from flax import nnx

from jaxsft import export, generate, lora, loss, models
from jaxsft.data.template import render_chat
from parity_utils import (batch_of, grad_rel_err, jax_logits, jax_sums, jax_sums_and_lora_grads, model_inputs,
                          pack, packed_example_losses, peft_copy, peft_named_grads, randomize_lora_b, set_peft_weights,
                          torch_logits, torch_lora_grads, torch_nll_sum64, torch_row_losses)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
  """(model_type, torch model, jaxsft model) with the same random weights."""
  kind = request.param
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(kind), dtype=torch.float32)
  with torch.no_grad():  # non-trivial norm weights (and biases), so that loading them is checked
    for name, p in hf.named_parameters():
      if p.ndim == 1:
        p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
  folder = tmp_path_factory.mktemp(f"tiny_{kind}")
  hf.save_pretrained(folder)
  return kind, hf.eval(), models.load_causal_lm(str(folder), dtype="float32")


def test_config_reads_the_family_and_writes_it_back(family):
  kind, torch_model, jax_model = family
  config = jax_model.config
  assert config.model_type == kind and config.architecture == type(torch_model).__name__
  assert models.from_hf_config(torch_model.config) == config
  written = transformers.AutoConfig.for_model(**models.to_hf_config(config))
  assert models.from_hf_config(written) == config
  # the layer kinds the tiny config was built to mix are really there
  kinds = {"mistral": (config.layer_windows(), {24}), "qwen3": (config.layer_windows(), {None, 24}), "gemma3_text": (config.layer_rope_kinds(), {"local", "global"}),
           "smollm3": (config.layer_rope_kinds(), {"none", "global"}), "phi3": (config.layer_windows(), {48}),
           "olmo2": ((config.norm_placement,), {"post"})}
  values, expected = kinds[kind]
  assert set(values) == expected


@pytest.mark.slow
@pytest.mark.parametrize("which", ["alpaca", "multiturn"])
def test_logits_and_loss_match_transformers(family, which, examples, multiturn_examples):
  kind, torch_model, jax_model = family
  batch = batch_of(examples[:4]) if which == "alpaca" else batch_of(multiturn_examples[:3], batch_size=4)
  assert (batch["attention_mask"] == 0).any()
  with torch.no_grad():
    t_logits = torch_logits(torch_model, batch)
  t_nll, t_count = torch_nll_sum64(t_logits, batch["labels"])
  j_logits = jax_logits(jax_model, model_inputs(batch))
  nll, count = loss.cross_entropy_sum(j_logits, batch["labels"])
  real = batch["attention_mask"] == 1
  gap = float(np.abs(t_logits.numpy()[real] - np.asarray(j_logits)[real]).max())
  delta = abs(float(nll) / int(count) - t_nll.item() / t_count)
  print(f"{kind}: max|Δlogits|={gap:.2e} |Δloss|={delta:.2e} loss={t_nll.item() / t_count:.4f}")
  assert int(count) == t_count > 0
  assert gap <= 1e-4
  assert delta <= 1e-5


@pytest.mark.slow
def test_packed_rows_give_transformers_per_example_losses(family, examples):
  kind, torch_model, jax_model = family
  feats = sorted(examples[:12], key=lambda f: len(f["input_ids"]))[:6]
  packed = pack(feats, 256)
  assert packed["segment_ids"].max() >= 2
  packed_losses = packed_example_losses(jax_model, packed)
  torch_losses = torch_row_losses(torch_model, batch_of(feats, buckets=(128,)))
  print(f"{kind}: max |Δ per-example loss| {np.abs(np.array(packed_losses) - torch_losses).max():.1e}")
  np.testing.assert_allclose(packed_losses, torch_losses, rtol=1e-5)


def _lora(jax_model, seed=0):
  return randomize_lora_b(lora.apply_lora(nnx.clone(jax_model), r=4, alpha=8, target_modules="all-linear",
                                          seed=seed))


# Gemma 3's embeddings are scaled by √hidden (×8 here) and its sandwich norms rescale every
# residual, so the float32 reduction-order noise of a re-padded batch is larger: 4-7e-6 on the
# LoRA gradients for 128 vs 192 columns. Computed in float64 the same two batches give the same
# loss exactly and gradients within 1.8e-7 (the float32 LoRA params' own rounding): noise, not a
# leak. The other families stay within 1e-6.
GRAD_NOISE_FLOOR = {"gemma3_text": 1e-5}


@pytest.mark.slow
def test_pad_id_and_bucket_change_neither_loss_nor_gradients(family, examples):
  kind, _, jax_model = family
  model = _lora(jax_model)
  feats = examples[:2]  # the batch of the peft gradient test below: one compiled program for both

  def run(batch):
    return jax_sums_and_lora_grads(model, model_inputs(batch), batch["labels"])

  (ref_nll, ref_n), ref_grads = run(batch_of(feats))
  for batch in (batch_of(feats, pad=0), batch_of(feats, buckets=(192,), batch_size=4)):
    (nll, n), grads = run(batch)
    assert int(n) == int(ref_n)
    assert abs(float(nll) - float(ref_nll)) <= 1e-6 * abs(float(ref_nll))
    assert grad_rel_err(grads, ref_grads) <= GRAD_NOISE_FLOOR.get(kind, 1e-6)


@pytest.mark.slow
def test_lora_gradients_on_every_linear_layer_match_peft(family, examples):
  kind, torch_model, jax_model = family
  model = _lora(jax_model)
  names = model.lora_settings.target_modules
  assert names == tuple(lora.module_paths(model))
  if kind == "phi3":
    assert names == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
  peft_model = peft_copy(torch_model, dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
  set_peft_weights(peft_model, lora.adapter_tensors(model))
  batch = batch_of(examples[:2])

  peft_model.zero_grad()
  t_nll, t_count = torch_nll_sum64(torch_logits(peft_model, batch), batch["labels"])
  (t_nll / t_count).backward()
  t_grads = torch_lora_grads(peft_model)
  (nll, count), grads = jax_sums_and_lora_grads(model, model_inputs(batch), batch["labels"])
  j_grads = peft_named_grads(model, loss.normalize_by_valid(grads, count))
  assert sorted(j_grads) == sorted(t_grads)
  err = grad_rel_err(j_grads, t_grads)
  t_loss = t_nll.item() / t_count
  print(f"{kind}: |Δloss|={abs(float(nll) / int(count) - t_loss):.1e} LoRA grad rel err {err:.1e}")
  assert abs(float(nll) / int(count) - t_loss) <= 1e-5
  assert err <= 1e-4


@pytest.mark.slow
def test_adapters_round_trip_between_jaxsft_and_peft(family, examples, tmp_path):
  kind, torch_model, jax_model = family
  batch = batch_of(examples[2:4], buckets=(96, 128))

  model = _lora(jax_model, seed=1)
  lora.save_adapter(model, tmp_path / "from_jax", base_model_name_or_path=kind)
  from_jax = peft_copy(torch_model, adapter=tmp_path / "from_jax")
  with torch.no_grad():
    nll, count = torch_nll_sum64(torch_logits(from_jax, batch), batch["labels"])
  j_nll, j_count = jax_sums(model, model_inputs(batch), batch["labels"])
  base_nll, _ = jax_sums(jax_model, model_inputs(batch), batch["labels"])
  assert abs(float(base_nll) - float(j_nll)) / int(j_count) > 1e-3  # the adapter moves the loss
  assert abs(float(j_nll) / int(j_count) - nll.item() / count) <= 1e-5

  # peft's own random adapter on the family's module names (the fused ones for Phi-3)
  targets = ["qkv_proj", "gate_up_proj"] if kind == "phi3" else ["k_proj", "o_proj", "up_proj"]
  torch.manual_seed(3)
  made_by_peft = peft_copy(torch_model, dict(r=4, lora_alpha=32, use_rslora=True, init_lora_weights=False,
                                             target_modules=targets))
  made_by_peft.save_pretrained(tmp_path / "from_peft")
  with torch.no_grad():
    nll, count = torch_nll_sum64(torch_logits(made_by_peft, batch), batch["labels"])
  loaded = lora.load_adapter(nnx.clone(jax_model), tmp_path / "from_peft")
  assert set(loaded.lora_settings.target_modules) == set(targets)
  j_nll, j_count = jax_sums(loaded, model_inputs(batch), batch["labels"])
  print(f"{kind}: peft->jaxsft |Δloss|={abs(float(j_nll) / int(j_count) - nll.item() / count):.1e}")
  assert abs(float(j_nll) / int(j_count) - nll.item() / count) <= 1e-5


@pytest.mark.slow
def test_greedy_generation_matches_transformers(family, tokenizer):
  kind, torch_model, jax_model = family
  prompts = [[{"role": "user", "content": "Name three rivers of Europe and say which is the longest of them."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
  got = generate.generate(jax_model, tokenizer, prompts, max_new_tokens=16)
  want = []
  stops = generate.stop_token_ids(tokenizer, jax_model)
  for messages in prompts:
    ids = tokenizer(render_chat(tokenizer, messages, generation_prompt=True), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
      out = torch_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=16, do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
    new = out[0, len(ids):].tolist()
    new = new[:next((i for i, t in enumerate(new) if t in stops), len(new))]
    want.append(tokenizer.decode(new, skip_special_tokens=True))
  print(f"{kind}: {want}")
  assert got == want
  assert all(want)


@pytest.mark.slow
def test_merged_hf_export_loads_in_transformers_with_peft_logits(family, tokenizer, tmp_path):
  kind, torch_model, jax_model = family
  base = tmp_path / "base"  # the fixture's weights with a tokenizer, as a user's base folder
  torch_model.save_pretrained(base)
  tokenizer.save_pretrained(base)
  tuned = randomize_lora_b(lora.apply_lora(nnx.clone(jax_model), r=8, alpha=16, target_modules="all-linear",
                                           seed=1), scale=0.02)
  lora.save_adapter(tuned, tmp_path / "adapter", base_model_name_or_path=str(base))
  text = render_chat(tokenizer, [{"role": "user", "content": "Which word comes after 'river'? stone, river, cloud"}],
                 generation_prompt=True)
  ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
  with torch.no_grad():
    want = peft_copy(torch_model, adapter=tmp_path / "adapter")(ids).logits.numpy()
    assert np.abs(want - torch_model(ids).logits.numpy()).max() > 1e-2  # the adapter changes the logits
    exported = transformers.AutoModelForCausalLM.from_pretrained(export.export(str(base), str(tmp_path / "adapter"),
                                                                               tmp_path / "hf"), dtype=torch.float32)
    got = exported.eval()(ids).logits.numpy()
  assert type(exported) is type(torch_model)
  err = float(np.abs(got - want).max())
  print(f"{kind}: merged HF export vs peft max |Δlogit| {err:.1e}")
  assert err <= 1e-4


# Each family switch, turned off, moves the logits far past the tolerance above: the checks
# would see a switch that jaxsft ignored or applied in the wrong place.
SWITCHES = {
    "mistral": [{"sliding_window": None}],
    "qwen3": [{"sliding_window": None, "layer_sliding": None}, {"qk_norm": None}],
    "gemma3_text": [{"rope_local_theta": None}, {"norm_unit_offset": False}, {"scale_embeddings": False},
                    {"query_pre_attn_scalar": None}, {"hidden_act": "silu"}, {"sliding_window": None, "layer_sliding": None}],
    "smollm3": [{"layer_rope": None}],
    "phi3": [{"partial_rotary_factor": 1.0}, {"sliding_window": None}],
    "olmo2": [{"qk_norm": None}, {"norm_weight_float32": False, "norm_placement": "post", "qk_norm": "head"}],
}


@pytest.mark.slow
def test_every_family_switch_changes_the_logits(family, examples):
  import dataclasses

  kind, torch_model, jax_model = family
  batch = batch_of(examples[:4])
  with torch.no_grad():
    t_logits = torch_logits(torch_model, batch).numpy()
  real = batch["attention_mask"] == 1
  tensors = models.to_hf_state_dict(jax_model)
  for change in SWITCHES[kind]:
    config = dataclasses.replace(jax_model.config, **change)
    keep = {k: v for k, v in tensors.items() if config.qk_norm is not None or not k.endswith(("q_norm.weight", "k_norm.weight"))}
    if config.qk_norm == "head" and jax_model.config.qk_norm == "projection":  # per head: the first head's weights
      keep = {k: (v[:config.head_dim] if k.endswith(("q_norm.weight", "k_norm.weight")) else v) for k, v in keep.items()}
    altered = models.from_hf_state_dict(config, keep)
    gap = float(np.abs(t_logits[real] - np.asarray(jax_logits(altered, model_inputs(batch)))[real]).max())
    print(f"{kind} {change}: max|Δlogits| {gap:.1e}")
    assert gap > 1e-3, change
