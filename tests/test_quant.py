"""Quantized frozen bases (jaxsft.quant): round trips within each format's bound, GGUF blocks equal
to the gguf package's own dequantization, and the quantized path equal to the float32 path on the
dequantized weights (loss and LoRA gradients) for every family."""

import copy
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsft import lora as lora_lib
from jaxsft import loss, quant
from jaxsft.models import decoder, families, hf_weights, loading, quantized
from jaxsft.models.gguf.names import GGUF_GLOBAL_NAMES, gguf_layer_names
from jaxsft.quant import formats
from tiny_model import FAMILY_CONFIGS, TINY, family_config

SMALL_VOCAB = 320  # the families' tiny models with a small vocabulary: the projections are the point here


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_round_trip_error_is_within_the_format_bound(fmt):
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((2, 128, 48)) * rng.uniform(0.01, 1.0, (2, 1, 48))).astype(np.float32)
  w[0, :64, 0] = 0.0  # an all-zero block must come back as zeros, not NaN
  q = formats.quantize(w, fmt, block=64)
  assert q.shape == w.shape
  back = np.asarray(formats.dequantize(q))
  err = np.abs(back - w).reshape(2, 2, 64, 48)
  bound = formats.error_bound(q) * (1 + 1e-6) + 1e-12
  assert np.all(err <= bound), f"{fmt}: {np.max(err - bound)} over the bound"
  np.testing.assert_array_equal(back[0, :64, 0], 0.0)
  assert np.mean(np.abs(back - w)) > 0  # it did quantize
  # numpy and jax dequantize identically (export uses one, the step the other), and so does the
  # transposed layout (an embedding table's) element by element
  np.testing.assert_array_equal(formats.dequantize(q, np.float32, xp=np), back)
  np.testing.assert_array_equal(np.asarray(formats.dequantize(q, transposed=True)), np.swapaxes(back, -1, -2))
  np.testing.assert_array_equal(formats.dequantize(q, np.float32, xp=np, transposed=True), np.swapaxes(back, -1, -2))
  bits = {"int8": 8, "int4": 4, "nf4": 4, "q4_1": 4}[fmt]
  assert q.codes.nbytes == w.size * bits // 8
  assert q.scales.dtype == np.float16 and (q.offsets is None or q.offsets.dtype == np.float16)


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_scales_are_rounded_outward_to_float16_and_float32_where_float16_cannot_hold_them(fmt):
  """Each float16 scale is the smallest one ≥ the exact block scale (an offset the largest ≤ the
  block minimum), so the codes fit the range; beyond float16's range a tensor keeps float32 ones."""
  rng = np.random.default_rng(3)
  w = (rng.standard_normal((64, 16)) * 0.02).astype(np.float32)
  exact = {"int8": 127, "int4": 7, "nf4": 1}
  q = formats.quantize(w, fmt, block=32)
  blocks = w.reshape(2, 32, 16)
  scales = q.scales.astype(np.float32)
  if fmt == "q4_1":
    low = q.offsets.astype(np.float32)
    assert np.all(low <= blocks.min(axis=1)) and np.all(np.nextafter(q.offsets, np.float16(np.inf)) > blocks.min(axis=1))
    needed = (blocks.max(axis=1) - low) / 15
  else:
    needed = np.abs(blocks).max(axis=1) / exact[fmt]
  assert np.all(scales >= needed) and np.all(np.nextafter(q.scales, np.float16(-np.inf)).astype(np.float32) < needed)
  assert formats.quantize(w, fmt, block=32, scale_dtype=np.float32).scales.dtype == np.float32  # asked for
  big = w * np.float32(1e6)  # weights up to ~1e5: past float16's largest, 65504
  q = formats.quantize(big, fmt, block=32)
  assert q.scales.dtype == np.float32
  err = np.abs(np.asarray(formats.dequantize(q)) - big).reshape(2, 32, 16)
  assert np.all(err <= formats.error_bound(q)[..., 0, :][:, None, :] * (1 + 1e-6))


def test_nf4_codes_are_the_nearest_of_the_qlora_code_book():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((64, 8)).astype(np.float32)
  q = formats.quantize(w, "nf4", block=64)
  codes = np.asarray(formats.unpack_nibbles(q.codes, np))
  normalized = w / q.scales[0]
  nearest = np.argmin(np.abs(normalized[..., None] - formats.NF4_CODE), axis=-1)
  np.testing.assert_array_equal(codes, nearest)


def test_block_size_must_divide_the_input_size():
  with pytest.raises(ValueError, match="not a multiple of the quantization block size 64"):
    formats.quantize(np.zeros((96, 8), np.float32), "nf4", 64)


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_a_quantized_embedding_table_reads_the_rows_it_looks_up(fmt):
  """A table (V, H) stored as its (H, V) kernel: the whole table is the dequantized kernel's
  transpose, and a lookup gathers the codes and scales of the ids' columns only, to the same
  rows exactly."""
  from jaxsft.quant.kernel import QuantizedKernel, table_rows, table_value

  rng = np.random.default_rng(2)
  table = rng.standard_normal((40, 96)).astype(np.float32)
  q = formats.quantize(table.T, fmt, block=32)
  variable = QuantizedKernel(jax.tree.map(jnp.asarray, q))
  whole = np.asarray(table_value(variable, jnp.float32))
  np.testing.assert_array_equal(whole, np.asarray(formats.dequantize(q)).T)
  assert np.abs(whole - table).max() <= formats.error_bound(q).max() * (1 + 1e-6)
  ids = jnp.asarray([[3, 0, 39, 3], [17, 17, 1, 2]])
  rows = np.asarray(table_rows(variable, ids, jnp.float32))
  assert rows.shape == (2, 4, 96)
  np.testing.assert_array_equal(rows, whole[np.asarray(ids)])
  picked = formats.take_columns(q, jnp.asarray([5, 1]))
  assert picked.codes.shape == q.codes.shape[:-1] + (2,) and picked.scales.shape == q.scales.shape[:-1] + (2,)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_equal_the_gguf_package_dequantization(ggml_type):
  import gguf
  from gguf.quants import dequantize, quantize

  from jaxsft.quant.gguf import gguf_blocks

  qtype = gguf.GGMLQuantizationType[ggml_type]
  rng = np.random.default_rng(2)
  weight = rng.standard_normal((24, 96)).astype(np.float32)  # (out, in) as stored
  raw = quantize(weight, qtype)

  class Tensor:  # the fields of a GGUFReader tensor gguf_blocks reads
    name, tensor_type, shape, data = "blk.0.attn_q.weight", qtype, np.array([96, 24]), raw

  q = gguf_blocks(Tensor)
  expected = np.asarray(dequantize(raw, qtype), np.float32)
  np.testing.assert_array_equal(np.asarray(formats.dequantize(q)).T, expected)
  # rows moved whole (llama.cpp's q/k permutation) move with their blocks
  perm = rng.permutation(24)
  moved = gguf_blocks(Tensor, row_map=lambda x: x[perm])
  np.testing.assert_array_equal(np.asarray(formats.dequantize(moved)).T, expected[perm])


def test_gguf_refuses_other_block_types():
  import gguf

  from jaxsft.quant.gguf import gguf_blocks

  class Tensor:
    name, tensor_type, shape, data = "blk.3.ffn_up.weight", gguf.GGMLQuantizationType.Q6_K, np.array([256, 4]), None

  with pytest.raises(ValueError, match=r"'blk.3.ffn_up.weight' is Q6_K"):
    gguf_blocks(Tensor)


def _with_random_lora(model, seed=0):
  lora_lib.apply_lora(model, r=4, alpha=8, target_modules="all-linear", seed=seed)
  key = jax.random.key(seed + 1)
  for i, (_, proj) in enumerate(quant.model.projections(model)):
    proj.lora_b.set_value(jax.random.normal(jax.random.fold_in(key, i), proj.lora_b.shape) * 0.05)
  return model


def _loss_and_lora_grads(model, input_ids, labels):
  graphdef, params, rest = nnx.split(model, nnx.LoRAParam, ...)

  def f(params, rest):  # the base is an argument: as a closed-over constant XLA would fold it
    return loss.masked_cross_entropy(nnx.merge(graphdef, params, rest)(input_ids), labels)

  value, grads = jax.jit(jax.value_and_grad(f))(params, rest)
  return value, grads


FAMILY_FORMATS = {"llama": "nf4", "qwen3": "int4", "gemma3_text": "int8", "smollm3": "nf4", "phi3": "int4",
                  "olmo2": "int8"}
# embeddings and LM head quantized too: a tied table (llama), a scaled tied one (gemma) and an
# untied head (phi3), one of each format; the other three keep them float32
QUANTIZED_EMBEDDINGS = ("llama", "gemma3_text", "phi3")


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILY_FORMATS))
def test_quantized_path_equals_the_float_path_on_the_dequantized_weights(family):
  """Loss and LoRA gradients of a quantized base equal those of the same model with the
  dequantized kernels (and tables) as ordinary float32 params (the family's tiny model, highest
  precision)."""
  config = dataclasses.replace(TINY if family == "llama" else family_config(family), vocab_size=SMALL_VOCAB)
  assert family == "llama" or family in FAMILY_CONFIGS
  fmt, embeddings = FAMILY_FORMATS[family], family in QUANTIZED_EMBEDDINGS
  model = decoder.init_random(config, seed=3)
  quant.quantize_model(model, fmt, block=32, embeddings=embeddings)
  assert quant.is_quantized(model) and quant.model.embeddings_quantized(model) == embeddings
  if family == "phi3":
    assert isinstance(model.lm_head, quant.QuantizedKernel)  # untied: its own quantized head
  _with_random_lora(model)
  dequantized = quant.dequantize_model(copy.deepcopy(model))
  assert not quant.is_quantized(dequantized) and not quant.model.embeddings_quantized(dequantized)
  assert dequantized.embed_tokens.shape == (SMALL_VOCAB, config.hidden_size)

  rng = np.random.default_rng(4)
  input_ids = jnp.asarray(rng.integers(3, 300, (2, 24)), jnp.int32)
  labels = input_ids.at[:, :5].set(-100)
  with jax.default_matmul_precision("highest"):
    loss_q, grads_q = _loss_and_lora_grads(model, input_ids, labels)
    loss_f, grads_f = _loss_and_lora_grads(dequantized, input_ids, labels)
  np.testing.assert_allclose(float(loss_q), float(loss_f), rtol=1e-6)
  flat_q, flat_f = jax.tree.leaves(grads_q), jax.tree.leaves(grads_f)
  assert len(flat_q) == len(flat_f) == 2 * len(quant.model.projections(model))
  for g_q, g_f in zip(flat_q, flat_f):
    g_q, g_f = np.asarray(g_q), np.asarray(g_f)
    assert np.abs(g_f).max() > 0
    assert np.abs(g_q - g_f).max() <= 1e-6 * np.abs(g_f).max()


def test_the_optimizer_sees_only_lora_params_and_the_base_is_stored_quantized():
  model = decoder.init_random(dataclasses.replace(TINY, vocab_size=SMALL_VOCAB), seed=0)
  float_bytes = quant.tree_bytes(nnx.state(model))
  quant.quantize_model(model, "nf4", block=32)
  _with_random_lora(model)
  _, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  assert all(isinstance(v, nnx.LoRAParam) for v in jax.tree.leaves(lora, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  kinds = {type(v).__name__ for v in jax.tree.leaves(frozen, is_leaf=lambda x: isinstance(x, nnx.Variable))}
  assert "QuantizedKernel" in kinds and "LoRAParam" not in kinds
  kernels = [proj.kernel for _, proj in quant.model.projections(model)]
  kernel_float_bytes = sum(int(np.prod(k.shape)) * 4 for k in kernels)
  kernel_bytes = quant.tree_bytes([k.get_value() for k in kernels])
  assert kernel_bytes == kernel_float_bytes * (4 + 16 / 32) / 32  # 4 bits + a float16 scale per 32 weights
  assert quant.tree_bytes(frozen) < float_bytes


def _write_quantized_gguf(path, model, ggml_type, embedding_type="F32"):
  """The tiny Llama as a GGUF file whose projections are `ggml_type` blocks (q/k permuted as
  llama.cpp does) and whose token embeddings (and LM head) are `embedding_type`."""
  import gguf
  from gguf.quants import quantize

  from test_model import llama_cpp_permute

  config = model.config
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
  globals_ = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}
  qtype = gguf.GGMLQuantizationType[ggml_type]
  for name, value in hf_weights.to_hf_state_dict(model).items():
    value = np.ascontiguousarray(value, np.float32)
    if name in ("model.embed_tokens.weight", "lm_head.weight") and embedding_type != "F32":
      embedding_qtype = gguf.GGMLQuantizationType[embedding_type]
      writer.add_tensor(globals_[name], quantize(value, embedding_qtype), raw_dtype=embedding_qtype)
      continue
    if name in globals_:
      writer.add_tensor(globals_[name], value)
      continue
    _, _, i, *rest = name.split(".")
    if ".q_proj." in name:
      value = llama_cpp_permute(value, config.num_heads)
    if ".k_proj." in name:
      value = llama_cpp_permute(value, config.num_kv_heads)
    gguf_name = f"blk.{i}.{names['.'.join(rest[:-1])]}.{rest[-1]}"
    if value.ndim == 2:
      writer.add_tensor(gguf_name, quantize(value, qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(gguf_name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.slow
def test_gguf_base_keeps_the_file_blocks_and_equals_the_dequantized_file(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXSFT_CACHE", str(tmp_path / "cache"))
  config = families.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16)
  _write_quantized_gguf(tmp_path / "tiny.gguf", decoder.init_random(config, seed=5), "Q4_1", "Q8_0")
  plain = loading.load_causal_lm(str(tmp_path / "tiny.gguf"))  # dequantized by gguf, float32
  blocks = loading.load_causal_lm(str(tmp_path / "tiny.gguf"), quantize="gguf")
  assert blocks.quantize == "gguf" and not quant.model.embeddings_quantized(blocks)
  for (path, p), (_, b) in zip(quant.model.projections(plain), quant.model.projections(blocks)):
    assert isinstance(b.kernel, quant.QuantizedKernel) and b.kernel.get_value().format == "q4_1"
    np.testing.assert_array_equal(np.asarray(quant.kernel_value(b.kernel, jnp.float32)), np.asarray(p.kernel[...]),
                                  err_msg=path)
  # the token embeddings' own Q8_0 blocks too: token v's row is column v of the (H, V) kernel
  with_table = loading.load_causal_lm(str(tmp_path / "tiny.gguf"), quantize="gguf", quantize_embeddings=True)
  table = with_table.embed_tokens.get_value()
  assert isinstance(table, formats.QuantizedTensor) and table.format == "int8" and table.shape == (64, 61)
  assert with_table.lm_head.get_value().format == "int8"  # this config's head is not tied
  np.testing.assert_array_equal(np.asarray(quant.kernel.table_value(with_table.embed_tokens, jnp.float32)),
                                np.asarray(plain.embed_tokens[...]))
  x = jnp.asarray([[1, 5, 9, 17, 33, 60]])
  np.testing.assert_array_equal(np.asarray(blocks(x)), np.asarray(plain(x)))
  np.testing.assert_array_equal(np.asarray(with_table(x)), np.asarray(plain(x)))


def test_gguf_embeddings_of_another_block_type_are_refused_naming_the_tensor(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXSFT_CACHE", str(tmp_path / "cache"))
  config = families.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                                num_kv_heads=2, head_dim=16)
  _write_quantized_gguf(tmp_path / "tiny.gguf", decoder.init_random(config, seed=5), "Q8_0")  # F32 embeddings
  assert loading.load_causal_lm(str(tmp_path / "tiny.gguf"), quantize="gguf").quantize == "gguf"
  with pytest.raises(ValueError, match=r"tiny.gguf: GGUF tensor 'token_embd.weight' is F32.*"
                                       r"set model.quantize_embeddings=false"):
    loading.load_causal_lm(str(tmp_path / "tiny.gguf"), quantize="gguf", quantize_embeddings=True)


def test_gguf_quantize_needs_a_gguf_file_and_a_known_format(tmp_path):
  with pytest.raises(ValueError, match="quantize must be one of"):
    loading.load_causal_lm("smollm2-135m-instruct", quantize="fp8")
  with pytest.raises(ValueError, match="quantize_embeddings needs a quantize format"):
    loading.load_causal_lm("smollm2-135m-instruct", quantize_embeddings=True)
  (tmp_path / "config.json").write_text(json.dumps(families.to_hf_config(TINY)))
  with pytest.raises(ValueError, match="is not a .gguf file"):
    loading.load_causal_lm(str(tmp_path), quantize="gguf")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
  from tiny_model import make_tiny_model_dir

  return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", tokenizer)


@pytest.mark.slow
def test_nf4_run_trains_resumes_and_reports_the_base_bytes(tiny_dir, tmp_path, monkeypatch):
  from jaxsft.data import synthetic
  from jaxsft.run_files import resolve_run
  from jaxsft.train import main

  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  data = synthetic.write_jsonl(synthetic.make_dataset(64, seed=1), tmp_path / "tasks.jsonl")
  out = tmp_path / "run"
  args = ["--model", str(tiny_dir), "--data", str(data), "--output-dir", str(out), "--lr", "2e-3",
          "--model.quantize", "nf4", "model.quantize_embeddings=true", "data.num_buckets=1", "data.batch_size=8", "data.tokens_per_batch=none",
          "data.max_val_examples=8", "eval.generate=false", "eval.eval_every=0", "save_every=2", "data.time_shapes=false",
          "--no-progress"]
  assert main([*args, "max_steps=2"]) == 0
  assert main([*args, "max_steps=4", "--resume"]) == 0
  lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  steps = [line["step"] for line in lines if "loss" in line]
  assert steps == [1, 2, 3, 4] and all(np.isfinite(line["loss"]) for line in lines if "loss" in line)
  summary = json.loads((out / "summary.json").read_text())
  config = next(line for line in lines if line.get("event") == "config")
  source = resolve_run(out)  # what chat and export load: the base quantized as the run trained it
  assert (source.quantize, source.quantize_embeddings) == ("nf4", True)
  # the (tied) embeddings (49,152 × 64) and the 2 layers' 7 kernels at 4 bits + a float16 scale per
  # 32 (the default block), the norms in float32
  weights = TINY.vocab_size * TINY.hidden_size + TINY.num_layers * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
  norms = (2 * TINY.num_layers + 1) * 64 * 4
  assert summary["base_param_bytes"] == config["base_param_bytes"] == norms + weights // 2 + weights // 32 * 2
  r = 16  # the embedded default: rank 16 on all seven projections, (in + out) · r float32 each
  in_plus_out = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128)
  assert summary["trainable_param_bytes"] == TINY.num_layers * 4 * r * in_plus_out


def test_full_mode_with_a_quantized_base_is_refused(tiny_dir, tmp_path, capsys):
  from jaxsft.train import main

  out = tmp_path / "never"
  assert main(["--model", str(tiny_dir), "--output-dir", str(out), "--model.quantize", "int8", "mode=full"]) == 2
  assert "model.quantize=int8" in capsys.readouterr().err and not out.exists()
  assert main(["--model", str(tiny_dir), "--output-dir", str(out), "model.quantize_embeddings=true"]) == 2
  assert "model.quantize_embeddings=true needs a model.quantize format" in capsys.readouterr().err
  assert not out.exists()


@pytest.mark.parametrize("embeddings", [False, True])
def test_export_writes_the_base_a_quantized_run_sees(tiny_dir, tmp_path, embeddings):
  from safetensors.numpy import load_file

  from jaxsft import export

  out = tmp_path / "nf4-base"
  flags = ["--quantize-embeddings"] if embeddings else []
  assert export.main(["--model", str(tiny_dir), "--quantize", "nf4", *flags, "--out", str(out)]) == 0
  written = load_file(str(out / "model.safetensors"))
  original = load_file(str(tiny_dir / "model.safetensors"))
  assert sorted(written) == sorted(original)
  quantized = ("proj.weight", "embed_tokens.weight") if embeddings else ("proj.weight",)
  for name, value in original.items():
    # (out, in): the kernel is its transpose, blocked along in; the table (V, H) is stored (H, V)
    if name.endswith(quantized):
      expected = formats.dequantize(formats.quantize(value.T, "nf4", formats.DEFAULT_BLOCK), np.float32, xp=np).T
      np.testing.assert_array_equal(written[name], expected, err_msg=name)
      assert not np.array_equal(written[name], value)
    else:  # norms (and, unless asked, the embeddings) are not quantized
      np.testing.assert_array_equal(written[name], value, err_msg=name)


@pytest.mark.slow
def test_real_smollm2_gguf_blocks_equal_their_dequantized_float_path(smollm2_jax):
  """The real SmolLM2: its GGUF Q4_1 blocks (and Q8_0 token embeddings) dequantize to exactly the
  weights the plain loader reads (gguf's own dequantization), and the loss and LoRA gradients of
  the gguf base equal those of the float32 path on the dequantized weights (nf4 and the others:
  the tiny models)."""
  plain = smollm2_jax  # read only
  rng = np.random.default_rng(6)
  input_ids = jnp.asarray(rng.integers(3, 49152, (1, 32)), jnp.int32)
  labels = input_ids.at[:, :8].set(-100)
  for fmt in ("gguf",):
    model = loading.load_causal_lm("smollm2-135m-instruct", dtype="float32", quantize=fmt, quantize_embeddings=True)
    if fmt == "gguf":
      for (path, p), (_, q) in zip(quant.model.projections(plain), quant.model.projections(model)):
        assert q.kernel.get_value().format == "q4_1"
        np.testing.assert_array_equal(np.asarray(quant.kernel_value(q.kernel, jnp.float32)), np.asarray(p.kernel[...]),
                                      err_msg=path)
      assert model.embed_tokens.get_value().format == "int8" and model.lm_head is None  # Q8_0, tied
      np.testing.assert_array_equal(np.asarray(quant.kernel.table_value(model.embed_tokens, jnp.float32)),
                                    np.asarray(plain.embed_tokens[...]))
    _with_random_lora(model)
    dequantized = quant.dequantize_model(copy.deepcopy(model))
    with jax.default_matmul_precision("highest"):
      loss_q, grads_q = _loss_and_lora_grads(model, input_ids, labels)
      loss_f, grads_f = _loss_and_lora_grads(dequantized, input_ids, labels)
    np.testing.assert_allclose(float(loss_q), float(loss_f), rtol=1e-6)
    for g_q, g_f in zip(jax.tree.leaves(grads_q), jax.tree.leaves(grads_f)):
      g_q, g_f = np.asarray(g_q), np.asarray(g_f)
      assert np.abs(g_q - g_f).max() <= 1e-6 * np.abs(g_f).max()


def _worker_fsdp_quantized(out_path):
  """In a 2-device interpreter: one trainer step of a tiny nf4 model with the frozen base
  sharded over fsdp=2, and the unsharded loss of the same batch."""
  import sys

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from benchmarks import common

  config = dataclasses.replace(TINY, vocab_size=SMALL_VOCAB)
  model = quant.quantize_model(decoder.init_random(config, seed=7), "nf4", block=32, embeddings=True)
  rng = np.random.default_rng(8)
  ids = rng.integers(3, SMALL_VOCAB, (2, 32)).astype(np.int32)
  labels = ids.copy()
  labels[:, :6] = -100
  with jax.default_matmul_precision("highest"):
    reference = float(loss.masked_cross_entropy(copy.deepcopy(model)(ids), labels))
    cfg = common.train_config()
    cfg.mesh.data, cfg.mesh.fsdp = 1, 2
    step = common.JaxsftStep(model, cfg)
    step.warm_up([(2, 32)])
    sharded = step.step({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels})
  codes = [leaf for leaf in jax.tree.leaves(step.frozen) if leaf.dtype == jnp.uint8]
  split = [len(leaf.sharding.device_set) == 2 and not leaf.sharding.is_fully_replicated for leaf in codes]
  pathlib.Path(out_path).write_text(json.dumps({"reference": reference, "sharded": sharded, "split": split}))


@pytest.mark.slow
def test_a_quantized_base_shards_over_fsdp_with_the_same_loss(tmp_path):
  import os
  import subprocess
  import sys
  import textwrap

  import worker_threads

  code = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
      import test_quant
      test_quant._worker_fsdp_quantized(sys.argv[1])
  """)
  env = dict(os.environ, HF_HUB_OFFLINE="1", XLA_FLAGS=worker_threads.xla_flags("--xla_force_host_platform_device_count=2"),
             JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
  r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out.json")], capture_output=True, text=True,
                     timeout=600, cwd=pathlib.Path(__file__).resolve().parents[1], env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  result = json.loads((tmp_path / "out.json").read_text())
  # every kernel's codes, and the embedding table's, really split over the 2 devices
  assert len(result["split"]) == 7 + 1 and all(result["split"])
  np.testing.assert_allclose(result["sharded"], result["reference"], rtol=1e-5)


@pytest.mark.parametrize("fmt, embeddings", [("nf4", True), ("int8", False)])
def test_a_random_quantized_base_is_drawn_in_its_stored_formats(fmt, embeddings):
  """init_random_quantized (the benchmarks' 8B bases): kernels drawn as codes, norms one, the rest
  N(0, 0.02²); the abstract draw has the same shapes and dtypes and allocates nothing."""
  config = dataclasses.replace(TINY, vocab_size=SMALL_VOCAB)
  model = quantized.init_random_quantized(config, fmt, seed=0, embeddings=embeddings, dtype="float32")
  abstract = quantized.init_random_quantized(config, fmt, seed=0, embeddings=embeddings, abstract=True,
                                               dtype="float32")
  assert quant.is_quantized(model) and quant.model.embeddings_quantized(model) == embeddings
  for _, proj in quant.model.projections(model):
    assert isinstance(proj.kernel, quant.QuantizedKernel) and proj.kernel.get_value().format == fmt
  leaves, abstract_leaves = jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(abstract))
  assert [(x.shape, x.dtype) for x in leaves] == [(x.shape, x.dtype) for x in abstract_leaves]
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in abstract_leaves)
  floats = [(path, v.get_value()) for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
  norms = [np.asarray(x) for path, x in floats if "norm" in ".".join(map(str, path))]
  others = [np.asarray(x).ravel() for path, x in floats if "norm" not in ".".join(map(str, path))]
  assert norms and all(np.all(x == 1) for x in norms)
  if embeddings:  # the tiny Llama has no biases: the norms are its only float weights left
    assert not others
  else:  # the embedding table (and LM head)
    others = np.concatenate(others)
    assert others.size > 1000 and abs(float(others.std()) - 0.02) < 0.002 and abs(float(others.mean())) < 0.002
