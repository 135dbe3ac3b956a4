"""LoRA without torch: PEFT init, trainable state, scale, dropout, merge, PEFT file format, errors."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxsft import lora, loss
from jaxsft.models import decoder, families, hf_weights, linear

TINY = families.LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                            num_kv_heads=2, head_dim=8)


def model(dtype="float32"):
  return decoder.init_random(TINY, seed=3, dtype=dtype)


def ids(b=2, t=7, seed=0):
  return np.random.default_rng(seed).integers(0, TINY.vocab_size, (b, t)).astype(np.int32)


def randomize_b(m, seed=0):
  """Nonzero B (a trained adapter) so LoRA changes the output."""
  for i, name in enumerate(m.lora_settings.target_modules):
    proj = lora._projection(m, name)
    proj.lora_b.set_value(jax.random.normal(jax.random.key(seed + i), proj.lora_b.shape) * 0.1)
  return m


@pytest.mark.slow
def test_init_like_peft_and_starts_equal_to_base():
  m = model()
  base = np.asarray(m(ids()))
  lora.apply_lora(m, r=16, alpha=32, target_modules="all-linear")
  for name in lora.ALL_LINEAR:
    proj = lora._projection(m, name)
    layers, fan_in, fan_out = proj.kernel.shape
    a, b = np.asarray(proj.lora_a[...]), np.asarray(proj.lora_b[...])
    assert a.shape == (layers, fan_in, 16) and b.shape == (layers, 16, fan_out)
    assert a.dtype == np.float32 and np.all(b == 0)
    bound = 1 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) on a (r, in) weight
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
    assert abs(a.std() - bound / math.sqrt(3)) < 0.15 * bound
  np.testing.assert_array_equal(np.asarray(m(ids())), base)
  assert m.lora_settings.scale == 2.0
  assert lora.apply_lora(model(), r=16, alpha=32, rslora=True).lora_settings.scale == 8.0


def test_target_modules():
  assert lora.resolve_target_modules("all-linear") == lora.ALL_LINEAR
  assert lora.resolve_target_modules(["v_proj", "q_proj"]) == ("q_proj", "v_proj")
  with pytest.raises(ValueError, match="lm_head"):
    lora.resolve_target_modules(["q_proj", "lm_head"])
  m = lora.apply_lora(model(), target_modules=("q_proj", "down_proj"))
  assert m.layers.mlp.down_proj.lora_a is not None and m.layers.self_attn.k_proj.lora_a is None


@pytest.mark.slow
def test_only_lora_params_are_trainable_and_stay_float32_on_bf16():
  m = lora.apply_lora(model("bfloat16"), r=4)
  x = ids()

  def f(m):
    return loss.masked_cross_entropy(m(x), x)

  value, grads = nnx.value_and_grad(f, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
  leaves = jax.tree.leaves(grads)
  assert len(leaves) == 4  # q and v, A and B
  assert all(leaf.dtype == jnp.float32 for leaf in leaves)
  assert m(x).dtype == m.activation_dtype and value.dtype == jnp.float32
  g_b = grads["layers"]["self_attn"]["q_proj"]["lora_b"][...]
  g_a = grads["layers"]["self_attn"]["q_proj"]["lora_a"][...]
  assert np.abs(np.asarray(g_b)).max() > 0 and np.all(np.asarray(g_a) == 0)  # B = 0 at init
  frozen = nnx.state(m, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(frozen))


def test_lora_math_matches_a_dense_update():
  m = randomize_b(lora.apply_lora(model(), r=4, alpha=12, target_modules=("o_proj",)))
  x = ids()
  proj = m.layers.self_attn.o_proj
  delta = np.einsum("lir,lro->lio", np.asarray(proj.lora_a[...]), np.asarray(proj.lora_b[...])) * 3.0
  dense = hf_weights.from_hf_state_dict(TINY, hf_weights.to_hf_state_dict(m))
  dense.layers.self_attn.o_proj.kernel.set_value(dense.layers.self_attn.o_proj.kernel[...] + delta)
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(np.asarray(m(x)), np.asarray(dense(x)), rtol=1e-5, atol=1e-5)
    merged = lora.merge_lora(m)
    assert merged.lora_settings is None and merged.layers.self_attn.o_proj.lora_a is None
    np.testing.assert_allclose(np.asarray(merged(x)), np.asarray(dense(x)), rtol=1e-5, atol=1e-5)


def dora(m, seed=0):
  """A DoRA adapter away from its init: B ≠ 0 and m ≠ ‖W + s·A B‖."""
  randomize_b(m, seed)
  for i, name in enumerate(m.lora_settings.target_modules):
    proj = lora._projection(m, name)
    proj.lora_magnitude.set_value(proj.lora_magnitude[...] * (1 + 0.3 * jax.random.normal(jax.random.key(50 + i), proj.lora_magnitude.shape)))
  return m


def test_dora_math_matches_the_rescaled_dense_weight_and_merges_to_it():
  """y = x W' with W' = (W + s·A B) · diag(m / ‖W + s·A B‖), the norm over the input axis."""
  m = dora(lora.apply_lora(model(), r=4, alpha=12, target_modules=("o_proj",), use_dora=True))
  proj = m.layers.self_attn.o_proj
  kernel = np.asarray(proj.kernel[...], np.float64)
  assert proj.lora_magnitude.shape == (TINY.num_layers, kernel.shape[-1])
  adapted = kernel + np.einsum("lir,lro->lio", np.asarray(proj.lora_a[...], np.float64),
                               np.asarray(proj.lora_b[...], np.float64)) * 3.0
  rescaled = adapted * (np.asarray(proj.lora_magnitude[...], np.float64) / np.linalg.norm(adapted, axis=1))[:, None, :]
  dense = hf_weights.from_hf_state_dict(TINY, hf_weights.to_hf_state_dict(m))
  dense.layers.self_attn.o_proj.kernel.set_value(jnp.asarray(rescaled, jnp.float32))
  x = ids()
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(np.asarray(m(x)), np.asarray(dense(x)), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(m(x)) - np.asarray(model()(x))).max() > 1e-3  # DoRA changed the output
    merged = lora.merge_lora(m)
    assert merged.lora_settings is None and merged.layers.self_attn.o_proj.lora_magnitude is None
    np.testing.assert_allclose(np.asarray(merged.layers.self_attn.o_proj.kernel[...]), rescaled, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(merged(x)), np.asarray(dense(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_dora", [False, True])
def test_base_of_a_tuned_model_computes_the_base_and_leaves_the_tuned_one(use_dora):
  """The tuned-vs-base comparison's base: a DoRA magnitude zeroed with the factors would scale the
  targeted projections' outputs to 0, so base_of gives it ‖W‖ instead."""
  tuned = lora.apply_lora(model(), r=4, alpha=8, target_modules=("q_proj", "down_proj"), use_dora=use_dora)
  tuned = dora(tuned) if use_dora else randomize_b(tuned)
  x = ids()
  tuned_logits = np.asarray(tuned(x))
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(np.asarray(lora.base_of(tuned)(x)), np.asarray(model()(x)), rtol=1e-5, atol=1e-5)
  assert np.abs(tuned_logits - np.asarray(model()(x))).max() > 1e-3  # the adapter changes the output
  np.testing.assert_array_equal(np.asarray(tuned(x)), tuned_logits)  # and base_of left it in place


def test_dora_with_dropout_is_peft_formula_and_the_norm_gets_no_gradient():
  """With dropout peft adds (g − 1)·x_d W + g·s·x_d A B to x W, x_d = dropout(x); and ∂/∂A, ∂/∂B
  treat the norm as a constant (peft detaches it)."""
  proj = linear.Linear(8, 6, bias=True, stack=(), dtype="float32", rng_index=0, rngs=nnx.Rngs(0))
  proj.bias.set_value(jnp.arange(6, dtype=jnp.float32) * 0.1)
  proj.lora_a = nnx.LoRAParam(jax.random.normal(jax.random.key(1), (8, 2)))
  proj.lora_b = nnx.LoRAParam(jax.random.normal(jax.random.key(2), (2, 6)))
  proj.lora_magnitude = nnx.LoRAParam(jnp.linspace(0.5, 1.5, 6))
  proj.lora_scale, proj.lora_dropout = 2.0, 0.5
  x = jax.random.normal(jax.random.key(3), (5, 8))
  key = jax.random.key(4)
  keep = jax.random.bernoulli(jax.random.fold_in(key, 0), 0.5, x.shape)
  x_d = jnp.where(keep, x / 0.5, 0)
  w, a, b, mag = (np.asarray(v, np.float64) for v in (proj.kernel[...], proj.lora_a[...], proj.lora_b[...],
                                                      proj.lora_magnitude[...]))
  g = mag / np.linalg.norm(w + 2.0 * a @ b, axis=0)
  x64, x_d64 = np.asarray(x, np.float64), np.asarray(x_d, np.float64)
  expected = x64 @ w + np.asarray(proj.bias[...]) + (g - 1) * (x_d64 @ w) + g * 2.0 * (x_d64 @ a @ b)
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(np.asarray(proj(x, key)), expected, rtol=1e-5, atol=1e-5)
    # The gradient with the norm held constant: g as a fixed array, differentiated by hand through B only.
    grad_b = nnx.grad(lambda p: jnp.sum(p(x) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam))(proj)["lora_b"][...]
  y = x64 @ w + np.asarray(proj.bias[...]) + (g - 1) * (x64 @ w) + g * 2.0 * (x64 @ a @ b)
  expected_grad_b = 2.0 * (x64 @ a).T @ (2 * y * g)  # ∂Σy²/∂B with g constant
  np.testing.assert_allclose(np.asarray(grad_b), expected_grad_b, rtol=1e-4, atol=1e-4)


def test_dora_adapter_saves_in_peft_format_and_loads_back(tmp_path):
  m = dora(lora.apply_lora(model(), r=4, alpha=8, target_modules=("q_proj", "up_proj"), use_dora=True))
  lora.save_adapter(m, tmp_path)
  tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
  assert len(tensors) == 3 * 2 * 3
  mag = tensors["base_model.model.model.layers.1.mlp.up_proj.lora_magnitude_vector"]
  assert mag.shape == (48,)
  np.testing.assert_array_equal(mag, np.asarray(m.layers.mlp.up_proj.lora_magnitude[...])[1])
  assert json.loads((tmp_path / "adapter_config.json").read_text())["use_dora"] is True
  fresh = lora.load_adapter(model(), tmp_path)
  assert fresh.lora_settings == m.lora_settings and fresh.lora_settings.use_dora
  np.testing.assert_array_equal(np.asarray(fresh(ids())), np.asarray(m(ids())))


@pytest.mark.slow
def test_dropout_needs_a_key_and_is_per_key():
  m = randomize_b(lora.apply_lora(model(), r=4, dropout=0.5))
  x = ids()
  no_key = np.asarray(m(x))
  np.testing.assert_array_equal(np.asarray(m(x)), no_key)
  k1, k2 = np.asarray(m(x, dropout_rng=jax.random.key(1))), np.asarray(m(x, dropout_rng=jax.random.key(2)))
  assert np.abs(k1 - no_key).max() > 1e-4 and np.abs(k1 - k2).max() > 1e-4
  np.testing.assert_array_equal(np.asarray(m(x, dropout_rng=jax.random.key(1))), k1)
  zero = randomize_b(lora.apply_lora(model(), r=4, dropout=0.0))
  np.testing.assert_array_equal(np.asarray(zero(x, dropout_rng=jax.random.key(1))), np.asarray(zero(x)))


def test_save_writes_peft_names_shapes_and_config(tmp_path):
  m = randomize_b(lora.apply_lora(model(), r=4, alpha=8, dropout=0.05, target_modules=("q_proj", "up_proj")))
  lora.save_adapter(m, tmp_path, base_model_name_or_path="tiny-base")
  tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
  assert len(tensors) == 3 * 2 * 2
  a = tensors["base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"]
  b = tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
  assert a.shape == (4, 32) and b.shape == (48, 4)
  np.testing.assert_array_equal(a, np.asarray(m.layers.self_attn.q_proj.lora_a[...])[2].T)
  config = json.loads((tmp_path / "adapter_config.json").read_text())
  expected = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8.0, "lora_dropout": 0.05,
              "target_modules": ["q_proj", "up_proj"], "use_rslora": False, "bias": "none",
              "fan_in_fan_out": False, "base_model_name_or_path": "tiny-base"}
  assert {k: config[k] for k in expected} == expected
  assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave no temporaries

  fresh = lora.load_adapter(model(), tmp_path)
  assert fresh.lora_settings == m.lora_settings
  np.testing.assert_array_equal(np.asarray(fresh(ids())), np.asarray(m(ids())))


def write_adapter(tmp_path, tensors, **config):
  save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
  base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
  (tmp_path / "adapter_config.json").write_text(json.dumps({**base, **config}))


def adapter_tensors(module="self_attn.q_proj", fan_in=32, fan_out=32, r=4, layers=3):
  out = {}
  for i in range(layers):
    out[f"base_model.model.model.layers.{i}.{module}.lora_A.weight"] = np.ones((r, fan_in), np.float32)
    out[f"base_model.model.model.layers.{i}.{module}.lora_B.weight"] = np.ones((fan_out, r), np.float32)
  return out


def test_load_errors_name_the_tensor(tmp_path):
  write_adapter(tmp_path, adapter_tensors(fan_out=64))
  with pytest.raises(ValueError, match=r"layers.0.self_attn.q_proj.lora_B.weight.*\(64, 4\).*\(32, 4\)"):
    lora.load_adapter(model(), tmp_path)
  write_adapter(tmp_path, adapter_tensors(module="self_attn.qkv_proj"))
  with pytest.raises(ValueError, match="qkv_proj"):
    lora.load_adapter(model(), tmp_path)
  write_adapter(tmp_path, {**adapter_tensors(), "base_model.model.lm_head.lora_A.weight": np.ones((4, 32), np.float32)})
  with pytest.raises(ValueError, match="lm_head"):
    lora.load_adapter(model(), tmp_path)
  partial = adapter_tensors()
  del partial["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
  write_adapter(tmp_path, partial)
  with pytest.raises(ValueError, match="layers.1.self_attn.q_proj.lora_A.weight is missing"):
    lora.load_adapter(model(), tmp_path)
  write_adapter(tmp_path, adapter_tensors(layers=4))
  with pytest.raises(ValueError, match="layers.3.*layer 3"):
    lora.load_adapter(model(), tmp_path)
  # DoRA: use_dora needs every layer's magnitude of the right shape, and a magnitude needs use_dora.
  write_adapter(tmp_path, adapter_tensors(), use_dora=True)
  with pytest.raises(ValueError, match=r"layers.0.self_attn.q_proj.lora_magnitude_vector is missing"):
    lora.load_adapter(model(), tmp_path)
  magnitudes = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_magnitude_vector": np.ones(32, np.float32)
                for i in range(3)}
  write_adapter(tmp_path, {**adapter_tensors(), **magnitudes})
  with pytest.raises(ValueError, match=r"lora_magnitude_vector.*DoRA.*use_dora"):
    lora.load_adapter(model(), tmp_path)
  write_adapter(tmp_path, {**adapter_tensors(), **magnitudes}, use_dora="yes")
  with pytest.raises(ValueError, match="use_dora must be true or false"):
    lora.load_adapter(model(), tmp_path)
  magnitudes["base_model.model.model.layers.2.self_attn.q_proj.lora_magnitude_vector"] = np.ones(31, np.float32)
  write_adapter(tmp_path, {**adapter_tensors(), **magnitudes}, use_dora=True)
  with pytest.raises(ValueError, match=r"layers.2.self_attn.q_proj.lora_magnitude_vector.*\(31,\).*\(32,\)"):
    lora.load_adapter(model(), tmp_path)
  write_adapter(tmp_path, adapter_tensors(), peft_type="IA3")
  with pytest.raises(ValueError, match="peft_type"):
    lora.load_adapter(model(), tmp_path)
  with pytest.raises(FileNotFoundError, match="adapter_config.json"):
    lora.load_adapter(model(), tmp_path / "nowhere")


@pytest.mark.slow
def test_dora_on_a_quantized_base_norms_the_dequantized_kernel():
  """A quantized base (QLoRA + DoRA): m starts at the dequantized kernel's column norms (peft
  dequantizes too), so the model starts at the quantized base, and the magnitude trains."""
  from jaxsft.quant import model as quant_model
  from jaxsft.quant.kernel import kernel_value

  m = quant_model.quantize_model(model(), "nf4", block=16)
  x = ids()
  base = np.asarray(m(x))
  lora.apply_lora(m, r=4, alpha=8, use_dora=True, target_modules=("q_proj", "down_proj"))
  proj = m.layers.mlp.down_proj
  np.testing.assert_allclose(np.asarray(proj.lora_magnitude[...]),
                             np.linalg.norm(np.asarray(kernel_value(proj.kernel, jnp.float32)), axis=1), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(m(x)), base, rtol=1e-5, atol=1e-5)
  grads = nnx.grad(lambda m: loss.masked_cross_entropy(m(x), x), argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
  assert np.abs(np.asarray(grads["layers"]["mlp"]["down_proj"]["lora_magnitude"][...])).max() > 0
