"""`jaxsft.models.stack16`: 16-bit layer stacks sliced as float32 bits, values and gradients unchanged."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsft import models
from jaxsft.models import stack16
from tests.tiny_model import TINY


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_pack_keeps_every_bit(dtype):
  bits = np.random.default_rng(0).integers(0, 2**16, (3, 5, 8), dtype=np.uint16)
  x = jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype)  # NaN payloads and infinities included
  packed = stack16.pack(x)
  assert packed.dtype == jnp.float32 and packed.shape == (3, 5, 4)
  back = stack16.unpack(packed, dtype)
  assert back.dtype == dtype and back.shape == x.shape
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(back, jnp.uint16)), bits)


def test_packable_leaves_only():
  assert stack16.packable(jnp.zeros((2, 6), jnp.bfloat16))
  assert not stack16.packable(jnp.zeros((2, 5), jnp.bfloat16))  # odd last axis
  assert not stack16.packable(jnp.zeros((6,), jnp.bfloat16))  # no layer axis
  assert not stack16.packable(jnp.zeros((2, 6), jnp.float32))
  tree = {"w": jnp.ones((2, 4, 6), jnp.bfloat16), "lora": jnp.ones((2, 4, 2), jnp.float32), "q": jnp.ones((2, 4), jnp.int8)}
  packed, dtypes = stack16.pack_tree(tree)
  assert dtypes == {"w": "bfloat16", "lora": "", "q": ""}
  assert packed["w"].dtype == jnp.float32 and packed["lora"] is tree["lora"] and packed["q"] is tree["q"]


def test_gradient_through_a_scanned_stack_is_unchanged():
  """A trained 16-bit stack (full fine-tuning) gets exactly the gradient it gets unpacked."""
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.normal(size=(3, 8, 8)), jnp.bfloat16)
  h0 = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)

  def loss(w, packed: bool):
    stack, dtypes = stack16.pack_tree({"w": w}) if packed else ({"w": w}, None)

    def layer(h, layer_w):
      layer_w = stack16.unpack_tree(layer_w, dtypes) if packed else layer_w
      return jnp.tanh(h @ layer_w["w"].astype(jnp.float32)) + h @ layer_w["w"].astype(jnp.float32).T, None

    return jnp.sum(jax.lax.scan(layer, h0, stack)[0] ** 2)

  grads = [jax.jit(jax.grad(loss), static_argnums=1)(w, packed) for packed in (False, True)]
  assert grads[1].dtype == jnp.bfloat16 and bool(jnp.any(grads[1] != 0))
  np.testing.assert_array_equal(np.asarray(grads[0], np.float32), np.asarray(grads[1], np.float32))


def _full_finetune_grads(monkeypatch, packed: bool):
  if not packed:
    monkeypatch.setattr(stack16, "pack_tree", lambda tree: (tree, None))
  model = models.init_random(TINY, dtype="bfloat16", seed=3)
  ids = jnp.asarray(np.random.default_rng(2).integers(3, TINY.vocab_size, (2, 16)), jnp.int32)

  def loss(model):
    logits = model(ids).astype(jnp.float32)
    return -jnp.mean(jax.nn.log_softmax(logits[:, :-1])[..., 0])

  return nnx.jit(nnx.grad(loss))(model)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's packing")
def test_full_finetune_gradients_match_the_unpacked_model(monkeypatch):
  packed = _full_finetune_grads(monkeypatch, packed=True)
  with monkeypatch.context() as m:
    plain = _full_finetune_grads(m, packed=False)
  leaves = jax.tree.leaves(nnx.state(packed)), jax.tree.leaves(nnx.state(plain))
  assert len(leaves[0]) == len(leaves[1]) > 0
  assert any(x.dtype == jnp.bfloat16 and x.ndim >= 2 and bool(jnp.any(x != 0)) for x in leaves[0])
  for a, b in zip(*leaves):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU float normalization")
def test_the_cpu_step_makes_no_float32_copy_of_the_stack():
  model = models.init_random(TINY, dtype="bfloat16", seed=0)
  ids = jnp.zeros((2, 16), jnp.int32)
  hlo = nnx.jit(lambda m: m(ids)).lower(model).compile().as_text()
  stacked = {f"f32[{TINY.num_layers},{','.join(map(str, x.shape[1:]))}]"
             for x in jax.tree.leaves(nnx.state(model.layers)) if x.dtype == jnp.bfloat16 and x.ndim >= 3}
  assert stacked  # the test looks for something
  # A conversion of a whole stack: a convert op, or a fusion XLA made of one (a `bitcast-convert`,
  # the packing itself, is neither).
  conversion = r"\{[0-9,]*\} (convert\(|fusion\(.*calls=%wrapped_convert)"
  converted = {shape for shape in stacked if re.search(rf"= {re.escape(shape)}{conversion}", hlo)}
  assert not converted, converted


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the stacks are packed on a CPU only")
def test_layers_packed_ahead_give_the_same_logits_and_are_not_packed_again():
  """`with_layers_packed` (what generation hands its jitted calls): the same logits bit for bit,
  and the compiled forward no longer packs a stack (the pack's word-building fusion, u32 stack-
  shaped, is in the plain forward and gone from the prepacked one)."""
  from jaxsft.models.decoder import with_layers_packed

  model = models.init_random(TINY, dtype="bfloat16", seed=0)
  graphdef, state = nnx.split(model)
  prepacked = nnx.merge(graphdef, with_layers_packed(state))
  assert any(isinstance(x, stack16.Packed) for x in jax.tree.leaves(
      nnx.state(prepacked.layers), is_leaf=lambda x: isinstance(x, stack16.Packed)))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 16)), jnp.int32)
  forward = lambda m: m(ids)  # noqa: E731
  np.testing.assert_array_equal(np.asarray(nnx.jit(forward)(prepacked)), np.asarray(nnx.jit(forward)(model)))
  words = {f"u32[{TINY.num_layers},{','.join(map(str, x.shape[1:-1]))},{x.shape[-1] // 2}]"
           for x in jax.tree.leaves(nnx.state(model.layers)) if stack16.packable(x)}
  assert words
  packs = lambda m: {w for w in words if w in nnx.jit(forward).lower(m).compile().as_text()}  # noqa: E731
  assert packs(model) and not packs(prepacked)


def test_unpacked_gives_back_every_bit_prepacked_took():
  rng = np.random.default_rng(4)
  tree = {"w": jnp.asarray(rng.normal(size=(3, 4, 6)), jnp.bfloat16),
          "h": jnp.asarray(rng.normal(size=(3, 6)), jnp.float16),
          "f": jnp.asarray(rng.normal(size=(3, 6)), jnp.float32),  # not 16-bit: left as it is
          "odd": jnp.asarray(rng.normal(size=(3, 5)), jnp.bfloat16)}  # odd last axis: left as it is
  packed = stack16.prepacked(tree)
  assert isinstance(packed["w"], stack16.Packed) and isinstance(packed["h"], stack16.Packed)
  assert packed["f"] is tree["f"] and packed["odd"] is tree["odd"]
  back = stack16.unpacked(packed)
  for key, x in tree.items():
    assert back[key].dtype == x.dtype and back[key].shape == x.shape
    np.testing.assert_array_equal(np.asarray(back[key]).view(np.uint8), np.asarray(x).view(np.uint8))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the stacks are packed on a CPU only")
def test_the_trainer_packs_the_frozen_stacks_once_and_saves_them_plain(tiny_dir, small_data, tmp_path):
  """A bfloat16 run's steps take the frozen base packed ahead (its compiled step builds no
  float32 words), and the model it saves, exports and evaluates has the plain weights it loaded."""
  from jaxsft import config_args
  from jaxsft.train import startup

  cfg = config_args.parse_args(["--model", str(tiny_dir), "--data", str(small_data), "--output-dir",
                                str(tmp_path / "run"), "model.dtype=bfloat16", "data.num_buckets=1",
                                "data.batch_size=8", "data.tokens_per_batch=none", "data.time_shapes=false",
                                "--no-progress"])
  run, state = startup.setup(cfg)
  try:
    shape = run.data.shapes[0]
    loaded = models.load_causal_lm(str(tiny_dir), dtype="bfloat16")
    words = {f"u32[{TINY.num_layers},{','.join(map(str, x.shape[1:-1]))},{x.shape[-1] // 2}]"
             for x in jax.tree.leaves(nnx.state(loaded.layers)) if stack16.packable(x)}
    assert words  # the test looks for something
    step_hlo = run.steps.compiled("train_step", shape).as_text()
    assert not {w for w in words if w in step_hlo}
    assert any(isinstance(x, stack16.Packed) for x in jax.tree.leaves(run.frozen, is_leaf=lambda x: isinstance(x, stack16.Packed)))

    model = run.model(state.trainable)
    plain = dict(nnx.to_flat_state(nnx.state(model.layers, nnx.Not(nnx.LoRAParam))))
    expected = dict(nnx.to_flat_state(nnx.state(loaded.layers)))
    assert plain.keys() == expected.keys()
    for path, x in plain.items():
      x, want = np.asarray(x[...]), np.asarray(expected[path][...])
      assert x.dtype == want.dtype and x.shape == want.shape, path
      np.testing.assert_array_equal(x.view(np.uint8), want.view(np.uint8))
  finally:
    run.files.unlock()
