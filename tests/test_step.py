"""The step functions: the schedule (optax's rates, an input of the compiled step), the logged learning
rate is the one AdamW used (skipped steps included), fused and split steps, padding and packing."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxsft import config as config_lib
from jaxsft import lora, models
from jaxsft import step as step_lib
from tiny_model import TINY


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("shape", ["cosine", "linear", "constant"])
def test_schedule_rates_are_optaxs(shape, warmup):
  o = config_lib.OptimConfig(lr=3e-4, schedule=shape, warmup_steps=warmup)
  total = 12
  if shape == "cosine":
    reference = optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, total, end_value=0.0)
  else:
    after = optax.linear_schedule(o.lr, 0.0, total - warmup) if shape == "linear" else optax.constant_schedule(o.lr)
    reference = optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup), after], [warmup]) if warmup else after
  schedule = step_lib.make_schedule(o, total)
  counts = range(total + 3)  # past the end too: the rate stays at its last value
  ours = jax.jit(lambda s, c: s.at(c, shape))
  np.testing.assert_allclose([float(ours(schedule, np.int32(c))) for c in counts], [float(reference(c)) for c in counts],
                             rtol=1e-6, atol=1e-12)


def _without_source_info(hlo_text):
  """The HLO text without the source file table and per-instruction metadata: where a traced
  line came from differs between two traces of the same code, the program does not."""
  tables = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
  body = "\n\n".join(part for part in hlo_text.split("\n\n") if not part.startswith(tables))
  return re.sub(r", metadata=\{[^}]*\}", "", body)


def test_the_compiled_step_takes_the_schedule_as_an_input():
  """Another learning rate, warmup or run length runs the same executable: no number of the
  schedule is a constant in it (the persistent cache then serves a sweep or a longer run)."""
  keys = ("input_ids", "attention_mask", "labels")
  texts, rates = [], []
  for lr, warmup, total in ((1e-3, 0, 10), (5e-2, 3, 1000)):
    cfg = config_lib.TrainConfig()
    cfg.optim.lr, cfg.optim.warmup_steps = lr, warmup
    cfg, graphdef, params, frozen, tx, fns, mesh = _setup(models.init_random(TINY, seed=0), cfg, total)
    schedule = step_lib.make_schedule(cfg.optim, total)
    steps = step_lib.CompiledSteps(fns, mesh.replicate(params), jax.jit(tx.init)(params), frozen, mesh, schedule)
    steps.warm_up([(2, 16)], keys, with_eval=False, fused=True)
    texts.append(_without_source_info(steps.compiled("train_step", (2, 16)).as_text()))
    batch = mesh.put_batch(_batch(2, 16, TINY.vocab_size))
    _, _, out = steps.train_step(mesh.replicate(params), jax.jit(tx.init)(params), frozen, batch, np.int32(0))
    rates.append(float(out["lr"]))
  assert "ENTRY" in texts[0] and texts[0] == texts[1]
  assert rates == [pytest.approx(1e-3), 0.0]  # each run's own numbers: 1e-3 at once, 0 at the start of warmup


def test_time_step_calls_twice_where_a_first_call_pays_one_off_costs(monkeypatch):
  """The first shape timed (the process's first step) and steps under REPEAT_UNDER_S: the faster of
  two calls; a longer step later: one call; `calls` overrides both. The state is never updated."""
  keys = ("input_ids", "attention_mask", "labels")
  cfg, graphdef, params, frozen, tx, fns, mesh = _setup(models.init_random(TINY, seed=0), config_lib.TrainConfig())
  steps = step_lib.CompiledSteps(fns, mesh.replicate(params), jax.jit(tx.init)(params), frozen, mesh,
                                 step_lib.make_schedule(cfg.optim, 10))
  steps.warm_up([(2, 16), (2, 32)], keys, with_eval=False, fused=True)
  made = []
  for shape in ((2, 16), (2, 32)):
    compiled = steps._compiled[("train_step", shape)]
    steps._compiled[("train_step", shape)] = lambda *a, _c=compiled, _s=shape: made.append(_s) or _c(*a)

  def calls(shape, **kw):
    made.clear()
    steps.time_step(shape, keys, fused=True, **kw)
    return len(made)

  monkeypatch.setattr(step_lib, "REPEAT_UNDER_S", 0.0)  # every step counts as long here
  assert calls((2, 16)) == 2  # the first timed
  assert calls((2, 32)) == 1 and calls((2, 32), trained=True) == 1
  assert calls((2, 32), calls=3) == 3
  monkeypatch.setattr(step_lib, "REPEAT_UNDER_S", 1e9)  # every step counts as short
  assert calls((2, 32)) == 2
  assert set(steps.step_seconds) == {(2, 16), (2, 32)} and set(steps.trained_step_seconds) == {(2, 32)}
  for a, b in zip(jax.tree.leaves(steps._trainable), jax.tree.leaves(mesh.replicate(params))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_logged_lr_is_the_rate_adamw_used_after_a_skipped_step():
  cfg = config_lib.TrainConfig()
  cfg.optim.schedule, cfg.optim.warmup_steps, cfg.optim.lr = "linear", 4, 1e-2
  model = models.init_random(TINY, seed=0)
  lora.apply_lora(model, r=2, alpha=4, seed=1)
  graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
  schedule = step_lib.make_schedule(cfg.optim, 10)
  tx = step_lib.make_optimizer(cfg.optim, schedule)
  fns = step_lib.make_step_functions(graphdef, cfg)
  opt_state = tx.init(params)
  good = fns.zeros(params)
  good = {**good, "grads": jax.tree.map(lambda g: g + 1.0, good["grads"]), "nll": jnp.float32(3.0),
          "n_valid": jnp.int32(2)}
  bad = {**good, "nll": jnp.float32(np.nan)}
  bad["grads"] = jax.tree.map(lambda g: g * np.nan, good["grads"])
  lrs, finite = [], []
  for acc in (good, bad, good, good):  # the second update is skipped
    params, opt_state, out = fns.apply(params, opt_state, acc, schedule)
    lrs.append(float(out["lr"]))
    finite.append(bool(out["finite"]))
  assert finite == [True, False, True, True]
  # AdamW applied updates 0, (skip), 1, 2: its schedule read counts 0, 1, 1, 2 — not the loop's 0..3.
  expected = [float(schedule.at(c, "linear")) for c in (0, 1, 1, 2)]
  assert lrs == expected and expected[2] != float(schedule.at(2, "linear"))
  assert int(step_lib.updates_applied(opt_state)) == 3


def _setup(model, cfg=None, total_steps=10):
  from jaxsft import sharding

  cfg = cfg or config_lib.TrainConfig()
  lora.apply_lora(model, r=2, alpha=4, seed=1)
  graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
  schedule = step_lib.make_schedule(cfg.optim, total_steps)
  tx = step_lib.make_optimizer(cfg.optim, schedule)
  fns = step_lib.make_step_functions(graphdef, cfg)
  return cfg, graphdef, params, frozen, tx, fns, sharding.make_mesh_context(cfg.mesh)


def _batch(b, t, vocab, seed=0, packed=False):
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, vocab, (b, t)).astype(np.int32)
  mask = np.ones((b, t), np.int32)
  mask[1, t - 5:] = 0
  labels = np.where(mask == 1, ids, -100)
  labels[:, : t // 2] = -100  # the prompt half is not trained
  batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
  if packed:
    half = t // 2
    batch["segment_ids"] = np.where(np.arange(t) < half, 1, 2).astype(np.int32)[None].repeat(b, 0) * mask
    batch["positions"] = np.where(np.arange(t) < half, np.arange(t), np.arange(t) - half).astype(np.int32)[None].repeat(b, 0)
    batch["labels"][:, half] = -100
  return batch


def _full_logits_sums(graphdef, params, frozen, batch):
  """The reference: logits at every position, then the masked cross-entropy."""
  from jaxsft import loss

  model = nnx.merge(graphdef, params, frozen)
  inputs = {k: batch[k] for k in step_lib.MODEL_INPUTS if k in batch}
  return loss.cross_entropy_sum(model(**inputs), batch["labels"])


def _compare_with_full_logits(model, batch, rtol):
  cfg, graphdef, params, frozen, tx, fns, _ = _setup(model)
  # Non-zero B (it starts at zero), so A's gradients are not zero on both sides.
  params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(2), x.shape), params)
  acc = jax.jit(fns.accumulate)(fns.zeros(params), params, frozen, batch, np.int32(0))
  (nll, n), grads = jax.jit(jax.value_and_grad(  # frozen an argument: a closed-over base is constant-folded
      lambda p, f: _full_logits_sums(graphdef, p, f, batch), has_aux=True))(params, frozen)
  assert int(acc["n_valid"]) == int(n) > 0
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))  # every factor's comparison can fail
  np.testing.assert_allclose(float(acc["nll"]), float(nll), rtol=rtol)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(acc["grads"])):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=rtol, atol=rtol * float(jnp.abs(a).max()))
  ev = jax.jit(fns.evaluate)(params, frozen, batch)
  np.testing.assert_allclose(float(ev[0]), float(nll), rtol=rtol)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_trained_positions_step_equals_full_logits_loss(packed):
  """The step's LM head only at trained positions: same Σ nll, count and LoRA gradients as
  logits everywhere (tiny model, bucket padding, a prompt half, packed rows)."""
  with jax.default_matmul_precision("highest"):
    _compare_with_full_logits(models.init_random(TINY, seed=0), _batch(3, 40, TINY.vocab_size, packed=packed), 1e-5)


@pytest.mark.slow
def test_trained_positions_loss_equals_full_logits_on_the_real_model(smollm2_jax):
  """SmolLM2's own final hidden states and 49,152 x 576 embedding: the trained-positions loss,
  in several chunks some of which are skipped, has the full-logits value and the same gradients
  with respect to the hidden states and the embedding (every gradient upstream, LoRA's included,
  follows from these two by the chain rule; the tiny-model test above checks the whole step)."""
  from jaxsft import loss

  model = smollm2_jax
  batch = _batch(2, 96, model.config.vocab_size, seed=3)
  labels = jnp.asarray(batch["labels"])
  with jax.default_matmul_precision("highest"):
    hidden = nnx.jit(lambda m, ids, mask: m.hidden_states(ids, mask))(
        model, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]))
    embedding = model.output_embedding()
    trained = jax.jit(jax.value_and_grad(
        lambda h, e: loss.trained_cross_entropy_sum(h, e, labels, chunk_size=32), argnums=(0, 1), has_aux=True))
    full = jax.jit(jax.value_and_grad(
        lambda h, e: loss.cross_entropy_sum(h @ e.T, labels), argnums=(0, 1), has_aux=True))
    (nll, n), grads = trained(hidden, embedding)
    (nll_ref, n_ref), grads_ref = full(hidden, embedding)
  assert int(n) == int(n_ref) > 2 * 32  # trained positions fill 3 of the 6 chunks; the rest are skipped
  np.testing.assert_allclose(float(nll), float(nll_ref), rtol=1e-5)
  for g, ref in zip(grads, grads_ref):
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))


@pytest.mark.slow
def test_fused_train_step_is_one_executable_equal_to_accumulate_then_apply(no_compile_cache):
  """grad_accum 1: one compiled executable per shape whose result is accumulate → apply's."""
  cfg, graphdef, params, frozen, tx, fns, mesh = _setup(models.init_random(TINY, seed=0))
  schedule = step_lib.make_schedule(cfg.optim, 10)
  batch = mesh.put_batch(_batch(2, 24, TINY.vocab_size))
  keys = ("input_ids", "attention_mask", "labels")
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  fused = step_lib.CompiledSteps(fns, mesh.replicate(params), jax.jit(tx.init)(params), frozen, mesh, schedule)
  counter = step_lib.compile_counter()
  before = counter.count
  fused.warm_up([(2, 24)], keys, with_eval=False, fused=True)
  assert counter.count - before == 1  # the whole step: zeros, accumulate and apply in one
  split = step_lib.CompiledSteps(fns, mesh.replicate(params), jax.jit(tx.init)(params), frozen, mesh, schedule)
  split.warm_up([(2, 24)], keys, with_eval=False)
  p1, o1, p2, o2 = copy(params), tx.init(params), copy(params), tx.init(params)
  for i in range(3):
    p1, o1, out1 = fused.train_step(p1, o1, frozen, batch, np.int32(i))
    p2, o2, out2 = split.apply(p2, o2, split.accumulate(split.zeros(p2), p2, frozen, batch, np.int32(i)))
    assert float(out1["loss"]) == pytest.approx(float(out2["loss"]), rel=1e-6)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  assert fused.recompiles == 0 and split.recompiles == 0 and not fused.unexpected_shapes


@pytest.mark.slow
def test_bucketed_packing_keeps_the_unpacked_unpadded_loss_and_gradients(tokenizer):
  """Every batch bucketed packing emits, accumulated: the Σ nll, Σ valid and LoRA gradients of
  the examples unpacked (one per row; padding changes nothing: see test_train's accumulation
  test); more fill rows and wider rows change nothing either."""
  from jaxsft import data
  from jaxsft.data import synthetic
  from jaxsft.data.rows import packed_batch

  with jax.default_matmul_precision("highest"):
    model = models.init_random(TINY, seed=0)
    model.embed_tokens[...] = model.embed_tokens[...] * 30.0  # a sharper output: per-example losses differ
    cfg, graphdef, params, frozen, tx, fns, _ = _setup(model)
    params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(2), x.shape), params)
    records = synthetic.make_dataset(16, seed=3)
    batches = list(data.make_batches(records, tokenizer, max_length=256, batching="bucketed_packed",
                                     bucket_lengths=[128, 256], batch_size=2, seed=1))
    assert {b["input_ids"].shape[1] for b in batches} == {128, 256} and any(b["segment_ids"].max() > 1 for b in batches)
    accumulate = jax.jit(fns.accumulate)
    keys = step_lib.BATCH_KEYS
    packed = fns.zeros(params)
    for i, b in enumerate(batches):
      packed = accumulate(packed, params, frozen, {k: b[k] for k in keys}, np.int32(i))
    examples = [e for e in data.tokenize_records(tokenizer, records, max_length=256).examples if e is not None]
    alone = accumulate(fns.zeros(params), params, frozen, data.collate(examples, pad_token_id=2, bucket_lengths=[256]),
                       np.int32(0))
    assert int(packed["n_valid"]) == int(alone["n_valid"]) == sum(int((e["labels"][1:] != -100).sum()) for e in examples)
    np.testing.assert_allclose(float(packed["nll"]), float(alone["nll"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(alone["grads"]), jax.tree.leaves(packed["grads"])):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4 * float(jnp.abs(a).max()))
    # Padding invariance: the first batch's examples in twice the rows, twice as wide, another pad id.
    first = [e for e in examples if len(e["input_ids"]) <= 64][:4]
    tight = packed_batch([first[:2], first[2:]], batch_size=2, width=128, pad_token_id=2)
    loose = packed_batch([first[:1], first[1:3], first[3:]], batch_size=4, width=256, pad_token_id=0)
    got = [accumulate(fns.zeros(params), params, frozen, batch, np.int32(0)) for batch in (tight, loose)]
    assert int(got[0]["n_valid"]) == int(got[1]["n_valid"]) > 0
    np.testing.assert_allclose(float(got[0]["nll"]), float(got[1]["nll"]), rtol=1e-6)
