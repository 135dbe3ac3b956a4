"""NEFTune: the noise's scale and support against alpha / sqrt(L·d) (L the real length, per packed
example), only in the training step, reproducible from the seed and the micro-batch index."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsft import config as config_lib
from jaxsft import config_args
from jaxsft import lora, models, neftune
from jaxsft import step as step_lib
from tiny_model import TINY


def _expected_bound(alpha, d, attention_mask, segment_ids=None):
  """alpha / sqrt(L·d) per position, written out row by row (0 at padding)."""
  bound = np.zeros(attention_mask.shape)
  for r in range(attention_mask.shape[0]):
    if segment_ids is None:
      length = attention_mask[r].sum()
      bound[r] = np.where(attention_mask[r] > 0, alpha / np.sqrt(length * d), 0.0)
    else:
      for s in set(segment_ids[r].tolist()) - {0}:
        at = segment_ids[r] == s
        bound[r, at] = alpha / np.sqrt(at.sum() * d)
  return bound


@pytest.mark.parametrize("packed", [False, True])
def test_noise_is_uniform_within_alpha_over_sqrt_real_length_times_d(packed):
  alpha, d, t = 5.0, 64, 48
  mask = np.ones((3, t), np.int32)
  mask[1, 30:] = 0  # right padding: L = 30, not 48
  mask[2, 7:] = 0
  segments = None
  if packed:  # row 0: examples of 10 and 38 tokens; row 1: 12 and 18 then padding; row 2: one of 7
    segments = np.zeros((3, t), np.int32)
    segments[0, :10], segments[0, 10:] = 1, 2
    segments[1, :12], segments[1, 12:30] = 1, 2
    segments[2, :7] = 1
  eps = np.asarray(neftune.noise(jax.random.key(3), alpha, (3, t, d), mask, segments))
  bound = _expected_bound(alpha, d, mask, segments)
  assert np.all(np.abs(eps) <= bound[..., None] * (1 + 1e-6))  # the support
  assert np.all(eps[mask == 0] == 0)  # none on padding
  # Each sequence's noise fills its interval: ε / bound is U(-1, 1), mean 0, variance 1/3, extremes near ±1.
  real = mask > 0
  unit = (eps / np.where(bound > 0, bound, 1)[..., None])[real]
  assert unit.size > 5000
  assert abs(unit.mean()) < 0.03 and abs(unit.var() - 1 / 3) < 0.02
  assert unit.min() < -0.999 and unit.max() > 0.999
  if packed:  # a packed example's scale is its own length's, not the row's
    assert bound[0, 0] == pytest.approx(alpha / np.sqrt(10 * d)) and bound[0, 20] == pytest.approx(alpha / np.sqrt(38 * d))
  else:
    assert bound[1, 0] == pytest.approx(alpha / np.sqrt(30 * d))


def _setup(alpha, seed=0):
  cfg = config_lib.TrainConfig(seed=seed, neftune_noise_alpha=alpha)
  model = models.init_random(TINY, seed=0)
  lora.apply_lora(model, r=2, alpha=4, seed=1)
  graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
  params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(2), x.shape), params)
  return cfg, graphdef, params, frozen, step_lib.make_step_functions(graphdef, cfg)


def _batch(b=2, t=24):
  rng = np.random.default_rng(0)
  ids = rng.integers(3, TINY.vocab_size, (b, t)).astype(np.int32)
  mask = np.ones((b, t), np.int32)
  mask[1, t - 6:] = 0
  labels = np.where(mask == 1, ids, -100)
  labels[:, : t // 3] = -100
  return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.slow
def test_the_step_adds_the_noise_of_its_seed_and_micro_batch_and_evaluation_none():
  batch = _batch()
  cfg, graphdef, params, frozen, fns = _setup(alpha=10.0)
  _, _, _, _, clean = _setup(alpha=None)
  accumulate = jax.jit(fns.accumulate)
  acc = lambda fns_, micro: accumulate(fns_.zeros(params), params, frozen, batch, np.int32(micro))  # noqa: E731
  noisy0, noisy0_again, noisy1 = acc(fns, 0), acc(fns, 0), acc(fns, 1)
  plain = jax.jit(clean.accumulate)(clean.zeros(params), params, frozen, batch, np.int32(0))
  # The training loss is the one of the embeddings plus the formula's noise, drawn from the key of
  # (seed, micro-batch index).
  model = nnx.merge(graphdef, params, frozen)
  hook = neftune.embedding_noise(neftune.noise_key(jax.random.key(cfg.seed), 0), 10.0, batch["attention_mask"])
  hidden = model.hidden_states(batch["input_ids"], batch["attention_mask"], embeddings_hook=hook)
  from jaxsft import loss

  expected, _ = loss.cross_entropy_sum(hidden @ model.output_embedding().T, batch["labels"])
  np.testing.assert_allclose(float(noisy0["nll"]), float(expected), rtol=2e-5)
  assert float(noisy0["nll"]) != float(plain["nll"])  # the noise is there and changes the loss
  # Reproducible: the same (seed, micro-batch) draws the same noise, another micro-batch another.
  assert float(noisy0_again["nll"]) == float(noisy0["nll"])
  assert float(noisy1["nll"]) != float(noisy0["nll"])
  for a, b in zip(jax.tree.leaves(noisy0["grads"]), jax.tree.leaves(noisy0_again["grads"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A fresh set of step functions of the same seed (a resumed run) draws it too; another seed does not.
  _, _, _, _, resumed = _setup(alpha=10.0)
  assert float(jax.jit(resumed.accumulate)(resumed.zeros(params), params, frozen, batch, np.int32(1))["nll"]) == float(noisy1["nll"])
  _, _, _, _, other_seed = _setup(alpha=10.0, seed=1)
  assert float(jax.jit(other_seed.accumulate)(other_seed.zeros(params), params, frozen, batch, np.int32(1))["nll"]) != float(noisy1["nll"])
  # Evaluation: exactly the noiseless loss.
  ev_noisy = jax.jit(fns.evaluate)(params, frozen, batch)
  ev_plain = jax.jit(clean.evaluate)(params, frozen, batch)
  assert float(ev_noisy[0]) == float(ev_plain[0]) and int(ev_noisy[1]) == int(ev_plain[1])
  np.testing.assert_allclose(float(ev_plain[0]), float(plain["nll"]), rtol=1e-6)


def test_noise_and_dropout_keys_differ():
  base = jax.random.key(0)
  dropout_keys = {tuple(np.asarray(jax.random.key_data(jax.random.fold_in(base, i)))) for i in range(64)}
  noise_keys = {tuple(np.asarray(jax.random.key_data(neftune.noise_key(base, i)))) for i in range(64)}
  assert len(noise_keys) == 64 and not dropout_keys & noise_keys


@pytest.mark.parametrize("value", ["-1", "nan", "abc"])
def test_a_bad_alpha_is_refused_naming_the_key(value):
  with pytest.raises(config_lib.ConfigError, match="neftune_noise_alpha"):
    config_args.parse_args(["--neftune-noise-alpha", value])


def test_alpha_on_the_command_line_and_in_yaml(tmp_path):
  assert config_args.parse_args(["--neftune-noise-alpha", "5"]).neftune_noise_alpha == 5.0
  assert config_args.parse_args(["neftune_noise_alpha=0.5"]).neftune_noise_alpha == 0.5
  assert config_args.parse_args([]).neftune_noise_alpha is None
  yaml_file = tmp_path / "c.yaml"
  yaml_file.write_text("neftune_noise_alpha: 15\n")
  assert config_args.parse_args(["--config", str(yaml_file)]).neftune_noise_alpha == 15.0
