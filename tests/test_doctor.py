"""The loss-curve doctor: every pattern on synthetic curves (several noise seeds), the metrics
reader and the CLI."""

import json

import numpy as np
import pytest

from jaxsft import doctor
from jaxsft.run_files import MetricsError, read_metrics

SEEDS = range(8)


def _noisy(rng, base, rel):
  """Batch-to-batch noise: `rel` of the level, Gaussian."""
  return base * (1 + rel * rng.standard_normal(base.shape))


# Each maker returns (steps, loss, extra diagnose kwargs).
def healthy(rng):
  t = np.arange(1, 81)
  return t, _noisy(rng, 0.7 + 1.8 * np.exp(-t / 13), 0.08), {}


def healthy_fast_drop_long_plateau(rng):
  t = np.arange(1, 201)
  return t, _noisy(rng, 0.9 + 2.5 * np.exp(-t / 4), 0.12), {}


def healthy_with_validation(rng):
  t = np.arange(1, 121)
  vs = np.arange(10, 121, 10)
  vl = 1.0 + 1.2 * np.exp(-vs / 25) + 0.01 * rng.standard_normal(vs.size)
  return t, _noisy(rng, 0.8 + 1.5 * np.exp(-t / 25), 0.1), {"val_steps": vs, "val_loss": vl}


def near_zero_in_first_epoch(rng):
  t = np.arange(1, 121)
  return t, np.abs(_noisy(rng, 0.005 + 2.0 * np.exp(-t / 6), 0.15)), {"steps_per_epoch": 60}


def healthy_noisy_short_like_a_real_run(rng):
  """Like the real default run: 40 steps, batch noise ~35% of the level, a slow fall."""
  t = np.arange(1, 41)
  vs = np.arange(10, 41, 10)
  vl = 2.4 + 1.0 * np.exp(-vs / 25)
  return t, _noisy(rng, 2.2 + 1.5 * np.exp(-t / 20), 0.35), {"val_steps": vs, "val_loss": vl}


def oscillating_spikes_that_decay(rng):
  """Too high an LR: every few steps an update knocks the loss up, and it recovers slowly."""
  t = np.arange(1, 81)
  kick = np.where(rng.random(t.size) < 0.15, rng.uniform(1.0, 3.0, t.size), 0.0)
  excess = np.zeros(t.size)
  for i in range(t.size):
    excess[i] = (0.7 * excess[i - 1] if i else 0.0) + kick[i]
  return t, 1.5 + excess + 0.1 * rng.standard_normal(t.size), {}


def oscillating_alternating(rng):
  t = np.arange(1, 61)
  return t, 1.5 + 0.4 * (-1.0) ** t + 0.15 * rng.standard_normal(t.size), {}


def oscillating_swings(rng):
  t = np.arange(1, 101)
  return t, 1.6 + 0.5 * np.sin(2 * np.pi * t / 9 + rng.uniform(0, 6)) + 0.15 * rng.standard_normal(t.size), {}


def overfitting_validation_rises(rng):
  t = np.arange(1, 151)
  vs = np.arange(10, 151, 10)
  vl = 1.0 + 1.2 * np.exp(-vs / 25) + 0.006 * np.maximum(vs - 60, 0) + 0.01 * rng.standard_normal(vs.size)
  return t, _noisy(rng, 0.3 + 1.7 * np.exp(-t / 30), 0.08), {"val_steps": vs, "val_loss": vl}


def overfitting_train_falls_then_rises(rng):
  t = np.arange(1, 101)
  return t, _noisy(rng, 1.0 + 1.5 * np.exp(-t / 10) + 0.012 * np.maximum(t - 40, 0), 0.06), {}


def flat_noisy(rng):
  t = np.arange(1, 81)
  return t, _noisy(rng, 2.4 - 0.001 * t, 0.12), {}


def flat_quiet(rng):
  t = np.arange(1, 81)
  return t, _noisy(rng, np.full(t.size, 1.9), 0.02), {}


def too_noisy_to_tell(rng):
  """Batch noise of 40% (few trained tokens per batch) and a model that does not change: 60 such
  points would not show a fall of a quarter either, so the curve alone cannot say "flat"."""
  t = np.arange(1, 61)
  return t, _noisy(rng, np.full(t.size, 3.4), 0.4), {}


def flat_very_noisy_validated(rng):
  """The same, with a held-out loss (no batch noise) that did not move."""
  t, loss, _ = too_noisy_to_tell(rng)
  return t, loss, {"val_steps": [0, 30, 60], "val_loss": [3.4, 3.41, 3.39]}


def flat_very_noisy_at_a_tiny_learning_rate(rng):
  """The same, trained at 1e-7: AdamW cannot move the adapter far enough to matter."""
  t, loss, _ = too_noisy_to_tell(rng)
  return t, loss, {"learning_rate": np.full(t.size, 1e-7)}


def diverging_rise(rng):
  t = np.arange(1, 61)
  return t, _noisy(rng, 2.0 + 0.08 * t, 0.1), {}


def diverging_nan(rng):
  t, loss, _ = healthy(rng)
  loss[-5:] = np.nan
  return t, loss, {}


CASES = {
    "healthy": [healthy, healthy_fast_drop_long_plateau, healthy_with_validation,
                healthy_noisy_short_like_a_real_run],
    "near_zero_early": [near_zero_in_first_epoch],
    "oscillating": [oscillating_spikes_that_decay, oscillating_alternating, oscillating_swings],
    "overfitting": [overfitting_validation_rises, overfitting_train_falls_then_rises],
    "flat": [flat_noisy, flat_quiet, flat_very_noisy_validated, flat_very_noisy_at_a_tiny_learning_rate],
    "too_noisy": [too_noisy_to_tell],
    "diverging": [diverging_rise, diverging_nan],
}


@pytest.mark.parametrize("expected,maker", [(p, m) for p, makers in CASES.items() for m in makers],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_synthetic_curves_are_classified(expected, maker):
  for seed in SEEDS:
    steps, loss, kwargs = maker(np.random.default_rng(seed))
    d = doctor.diagnose(steps, loss, **kwargs)
    assert d.pattern == expected, (seed, d.summary, d.evidence)
    assert d.likely_cause and d.fix and d.summary
    assert d.pattern in doctor.PATTERNS
    # SmolLM2's vocabulary (ln 49152 = 10.8) changes no curve that stays below it
    assert doctor.diagnose(steps, loss, **kwargs, vocab_size=49152).pattern == expected, seed


def test_advice_matches_the_table():
  rng = np.random.default_rng(0)
  assert "5-10x" in doctor.diagnose(*near_zero_in_first_epoch(rng)[:2], steps_per_epoch=60).fix
  d = doctor.diagnose(*oscillating_alternating(rng)[:2])
  assert "gradient accumulation" in d.fix and "learning rate" in d.likely_cause
  d = doctor.diagnose(*overfitting_train_falls_then_rises(rng)[:2])
  assert "early stopping" in d.fix and "dropout" in d.fix
  d = doctor.diagnose(*flat_quiet(rng)[:2])
  assert "trainable parameters" in d.fix and "too low" in d.likely_cause


def test_near_zero_early_that_validation_confirms_is_a_learned_task():
  rng = np.random.default_rng(0)
  t, loss, _ = near_zero_in_first_epoch(rng)
  falling = doctor.diagnose(t, loss, steps_per_epoch=60, val_steps=[0, 60, 120], val_loss=[3.0, 0.4, 0.2])
  assert falling.pattern == "healthy" and falling.evidence["near_zero_confirmed_by_validation"]
  # Held-out loss that stalls or turns up does not confirm it: still near_zero_early.
  for val_loss in ([3.0, 2.8, 2.9], [3.0, 0.4, 0.6]):
    d = doctor.diagnose(t, loss, steps_per_epoch=60, val_steps=[0, 60, 120], val_loss=val_loss)
    assert d.pattern == "near_zero_early", (val_loss, d.pattern)


def test_near_zero_after_the_first_epoch_is_not_early():
  t = np.arange(1, 301)
  loss = 0.02 + 2.0 * np.exp(-t / 60)  # reaches ~0 only in epoch 3 of 100 steps
  assert doctor.diagnose(t, loss, steps_per_epoch=100).pattern != "near_zero_early"
  assert doctor.diagnose(t, loss, steps_per_epoch=300).pattern == "near_zero_early"


def test_validation_rising_with_train_rising_too_is_not_overfitting():
  t = np.arange(1, 101)
  loss = 1.0 + 1.5 * np.exp(-t / 10) + 0.004 * np.maximum(t - 40, 0)  # train rises 10% late
  vs = np.arange(10, 101, 10)
  vl = 1.2 + 0.01 * np.abs(vs - 40)  # best at step 40, where train is lowest
  d = doctor.diagnose(t, loss, val_steps=vs, val_loss=vl)
  assert d.evidence["val_rise_rel"] > 0.3 and d.evidence["train_change_since_val_min"] > 0.02
  assert "validation loss rose" not in d.summary


def test_too_short_and_bad_shapes():
  assert doctor.diagnose([1, 2, 3], [2.0, 1.5, 1.2]).pattern == "too_short"
  with pytest.raises(ValueError, match="3 train steps but 2"):
    doctor.diagnose([1, 2, 3], [1.0, 2.0])
  with pytest.raises(ValueError, match="2 validation steps but 1"):  # however short the curve
    doctor.diagnose([1, 2, 3], [2.0, 1.5, 1.2], val_steps=[0, 3], val_loss=[2.1])


def test_evidence_is_json_serializable():
  steps, loss, kwargs = healthy_with_validation(np.random.default_rng(1))
  d = doctor.diagnose(steps, loss, **kwargs)
  json.dumps(d.evidence)
  for key in ("first_level", "last_level", "rel_drop", "noise", "trend_to_noise", "val_min"):
    assert key in d.evidence
  assert d.pattern in d.report() and d.fix in d.report()


def _write_run(run_dir, steps, loss, *, val=None, steps_per_epoch=None, extra_lines=()):
  run_dir.mkdir(parents=True, exist_ok=True)
  lines = []
  if steps_per_epoch:
    lines.append({"event": "config", "steps_per_epoch": steps_per_epoch, "lr": 2e-4})
  val = dict(val or {})
  for s, l in zip(steps, loss):
    line = {"step": int(s), "loss": float(l), "lr": 1e-4, "grad_norm": 0.5}
    if int(s) in val:
      line["val_loss"] = val.pop(int(s))
    lines.append(line)
    if steps_per_epoch and int(s) % steps_per_epoch == 0:
      lines.append({"step": int(s), "epoch": int(s) // steps_per_epoch, "epoch_loss": 1.0})
  lines += [{"step": int(s), "val_loss": v} for s, v in val.items()]
  lines += list(extra_lines)
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  return run_dir


def test_load_metrics(tmp_path):
  steps, loss, _ = healthy(np.random.default_rng(0))
  run = _write_run(tmp_path / "run", steps, loss, val={10: 2.0, 20: 1.5, 85: 1.2},
                   extra_lines=[{"event": "summary", "seconds": 3.0}, {"step": 3, "tokens": 10}])
  m = read_metrics(run)
  assert m.train_steps == list(range(1, 81)) and np.allclose(m.train_loss, loss)
  assert m.val_steps == [10, 20, 85] and m.val_loss == [2.0, 1.5, 1.2]
  assert m.steps_per_epoch is None
  assert m.train_lr == [1e-4] * 80 and m.train_grad_norm == [0.5] * 80
  assert read_metrics(run / "metrics.jsonl") == m

  # epoch length from the config line, or else from the first epoch-end line
  run2 = _write_run(tmp_path / "run2", steps, loss, steps_per_epoch=20)
  assert read_metrics(run2).steps_per_epoch == 20
  assert read_metrics(run2).epoch_end_steps == [20, 40, 60, 80]
  text = (run2 / "metrics.jsonl").read_text().splitlines()
  (run2 / "metrics.jsonl").write_text("\n".join(text[1:]) + "\n")
  assert read_metrics(run2).steps_per_epoch == 20


def test_resumed_run_later_lines_win(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3))
                  + "".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (2, 3, 4)))
  m = read_metrics(path)
  assert m.train_steps == [1, 2, 3, 4] and m.train_loss == [9.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ('{"step": 4, "loss": "high"}', "field 'loss' must be a number"),
    ('{"step": "4", "loss": 1.0}', "field 'step' must be an integer"),
    ('{"loss": 1.0}', "needs a 'step' field"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_metrics_line_names_file_and_line(tmp_path, line, message):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n' + line + "\n")
  with pytest.raises(MetricsError, match=message) as info:
    read_metrics(tmp_path)
  assert f"{path}:3" in str(info.value)


def test_cli_prints_the_diagnosis(tmp_path, run_cli):
  steps, loss, kwargs = overfitting_validation_rises(np.random.default_rng(0))
  run = _write_run(tmp_path / "run", steps, loss, val=dict(zip(kwargs["val_steps"].tolist(),
                                                               kwargs["val_loss"].tolist())))
  result = run_cli(doctor.main, [run])
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "loss curve: overfitting" in out and "val_rise_rel" in out
  assert "likely cause:" in out and "early stopping" in out
  as_json = json.loads(run_cli(doctor.main, [run, "--json"]).stdout)
  assert as_json["pattern"] == "overfitting" and as_json["evidence"]["val_points"] == 15


def test_cli_missing_or_empty_metrics_exit_2(tmp_path, run_cli):
  result = run_cli(doctor.main, [tmp_path / "nope"])
  assert result.returncode == 2 and "no metrics file" in result.stderr and "nope" in result.stderr
  (tmp_path / "metrics.jsonl").write_text('{"event": "config", "steps_per_epoch": 5}\n')
  result = run_cli(doctor.main, [tmp_path])
  assert result.returncode == 2 and "no training loss lines" in result.stderr
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n')
  result = run_cli(doctor.main, [tmp_path])
  assert result.returncode == 2 and "metrics.jsonl:2" in result.stderr


def test_plateau_or_still_falling():
  rng = np.random.default_rng(0)
  steps, loss, kwargs = healthy_with_validation(rng)
  d = doctor.diagnose(steps, loss, **kwargs)
  assert d.evidence["plateaued"] and "leveled off" in d.summary
  steps, loss, kwargs = healthy_noisy_short_like_a_real_run(rng)  # validation still falling
  d = doctor.diagnose(steps, loss, **kwargs)
  assert not d.evidence["plateaued"] and "more steps" in d.fix
  t = np.arange(1, 61)
  d = doctor.diagnose(t, 3.0 - 0.03 * t)  # a straight line down never plateaus
  assert d.pattern == "healthy" and not d.evidence["plateaued"]


def test_early_blow_up_that_settles_high_is_diverging_not_overfitting():
  """A far too high LR: the loss explodes within the first steps, then settles well above where
  it started, and the held-out loss ends above the base model's (step 0). The start median
  already contains the explosion, so only the first step and validation tell."""
  rng = np.random.default_rng(0)
  train = [3.5, 8.3, 25.8, 45.6, 62.7, 21.0, 29.7, 21.8, 12.0, 8.4] + list(9.5 + 2 * rng.standard_normal(10))
  d = doctor.diagnose(range(1, 21), train, val_steps=[0, 5, 10, 15, 20], val_loss=[4.86, 26.3, 13.1, 10.4, 10.0])
  assert d.pattern == "diverging", d.report()
  assert "learning rate" in d.likely_cause
  # validated only before step 1 and at the end: the same two ends tell
  d = doctor.diagnose(range(1, 21), train, val_steps=[0, 20], val_loss=[4.86, 10.0])
  assert d.pattern == "diverging" and d.evidence["val_rise_from_first"] > 1, d.report()


# 8-step runs of SmolLM2-135M-Instruct (`tests/test_real_runs.py`'s doctor settings at 8 steps),
# the same first batch at several learning rates: losses, then gradient norms. All "rise" from the
# first step's 2.05, which was an easy batch; lr 0.03 and 0.3 end near or far above where a uniform
# guess over 49,152 tokens sits (ln 49152 = 10.8), lr 0.01 spikes and comes back.
SMOLLM2_LR_0_3 = [2.05, 15.738, 30.26, 24.912, 54.178, 24.18, 29.331, 23.507]
SMOLLM2_LR_0_03 = [2.05, 7.273, 12.383, 33.244, 13.519, 12.8, 10.315, 11.444]
SMOLLM2_LR_0_01 = [2.05, 2.618, 3.001, 7.858, 7.165, 2.364, 1.61, 2.861]
SMOLLM2_LR_0_01_GRADS = [4.67, 13.17, 12.3, 33.28, 25.15, 8.48, 7.79, 10.66]
SMOLLM2_LR_1E_7 = [2.05, 3.912, 2.887, 4.101, 3.41, 4.737, 3.466, 4.176]
SMOLLM2_LR_1E_7_GRADS = [4.67, 6.62, 5.1, 6.35, 4.6, 4.97, 5.22, 4.82]


def test_short_wild_run_above_the_uniform_level_is_diverging():
  """Eight wild points: the start median (15.7) holds the blow-up and Mann-Kendall sees no trend,
  so without the vocabulary (and the gradient norms) the curve read as "flat", whose advice is to
  raise the learning rate."""
  high = doctor.diagnose(range(1, 9), SMOLLM2_LR_0_3, vocab_size=49152)
  assert high.pattern == "diverging", high.report()
  assert "learning rate far too high" in high.likely_cause
  assert high.evidence["uniform_level"] == pytest.approx(np.log(49152), abs=1e-6)
  near = doctor.diagnose(range(1, 9), SMOLLM2_LR_0_03, vocab_size=49152)  # ends at 1.06 ln V
  assert near.pattern == "diverging" and "uniform_level" in near.evidence, near.report()
  low = doctor.diagnose(range(1, 9), SMOLLM2_LR_1E_7, vocab_size=49152, grad_norm=SMOLLM2_LR_1E_7_GRADS,
                        learning_rate=[1e-7] * 8)
  assert low.pattern == "flat", low.report()
  assert "uniform_level" not in low.evidence
  # the summary says which way the levels moved (2.887 -> 4.176 is a rise)
  assert "(+44.6%)" in low.summary and "no significant trend" in low.summary


def test_above_the_uniform_level_needs_a_rise_from_the_first_step():
  """A model trained from scratch starts at ln V: a flat run there is not diverging."""
  rng = np.random.default_rng(0)
  t = np.arange(1, 41)
  level = np.log(49152)
  flat = level * (1 + 0.02 * rng.standard_normal(t.size))
  assert doctor.diagnose(t, flat, vocab_size=49152).pattern == "flat"
  jumped = doctor.diagnose(t, np.r_[flat[:1], 1.3 * flat[1:]], vocab_size=49152)  # 30% up after step 1
  assert jumped.pattern == "diverging" and "uniform_level" in jumped.evidence, jumped.report()


def test_the_run_folder_gives_the_doctor_its_vocabulary(tmp_path, run_cli):
  run = _write_run(tmp_path / "run", range(1, 9), SMOLLM2_LR_0_3)
  lines = (run / "metrics.jsonl").read_text()
  (run / "metrics.jsonl").write_text(json.dumps({"event": "config", "steps_per_epoch": 113, "vocab_size": 49152})
                                     + "\n" + lines)
  assert read_metrics(run).vocab_size == 49152
  as_json = json.loads(run_cli(doctor.main, [run, "--json"]).stdout)
  assert as_json["pattern"] == "diverging" and "ln(49152)" in as_json["summary"]


def test_a_gradient_norm_spike_without_a_trend_is_oscillating_not_flat():
  """lr 0.01: the loss went 2.05 -> 7.9 and back, the gradient norm 4.67 -> 33 (7x); from the
  losses alone the eight points hold no trend, and too much noise to tell."""
  assert doctor.diagnose(range(1, 9), SMOLLM2_LR_0_01, learning_rate=[0.01] * 8).pattern == "too_noisy"
  d = doctor.diagnose(range(1, 9), SMOLLM2_LR_0_01, grad_norm=SMOLLM2_LR_0_01_GRADS, vocab_size=49152)
  assert d.pattern == "oscillating" and "learning rate too high" in d.likely_cause, d.report()
  assert d.evidence["grad_norm_max_over_first"] == pytest.approx(33.28 / 4.67, rel=1e-4)
  # a model that does not change keeps its gradient norm (lr 1e-7: at most 1.4x the first step's)
  d = doctor.diagnose(range(1, 9), SMOLLM2_LR_1E_7, grad_norm=SMOLLM2_LR_1E_7_GRADS, learning_rate=[1e-7] * 8)
  assert d.pattern == "flat" and d.evidence["grad_norm_max_over_first"] < 1.5, d.report()


# The same settings at lr 3e-3 (cosine from 3e-3, no warmup): a rate that works (20 steps of it
# fall from 2.05 to ~0.5), but 8 steps of ~10 trained tokens hold no significant trend.
SMOLLM2_LR_3E_3 = [2.05, 2.764, 0.894, 1.485, 1.205, 2.444, 0.329, 1.188]
SMOLLM2_LR_3E_3_GRADS = [4.67, 4.24, 6.59, 5.14, 3.31, 5.15, 1.99, 2.37]
COSINE_3E_3 = [3e-3 * (1 + np.cos(np.pi * i / 8)) / 2 for i in range(8)]


def test_a_short_noisy_run_at_a_working_rate_is_too_noisy_not_flat():
  """Before, this curve read "flat" and the advice was to raise the learning rate."""
  d = doctor.diagnose(range(1, 9), SMOLLM2_LR_3E_3, grad_norm=SMOLLM2_LR_3E_3_GRADS, vocab_size=49152,
                      learning_rate=COSINE_3E_3)
  assert d.pattern == "too_noisy", d.report()
  assert "raise the learning rate" not in d.fix and "eval.eval_every" in d.fix
  assert d.evidence["peak_lr"] == pytest.approx(3e-3) and -1 < d.evidence["detectable_fall_z"] < 0
  assert "2.05 -> 1.188 (-42.0%)" in d.summary
  # the same curve at 1e-7 is flat: the learning rate itself says the adapter cannot move
  low = doctor.diagnose(range(1, 9), SMOLLM2_LR_3E_3, learning_rate=[1e-7] * 8)
  assert low.pattern == "flat" and "peaked at 1e-07" in low.summary, low.report()
  # a held-out loss that moved by under 10% (before step 1 and at the end) says the model is still
  still = doctor.diagnose(range(1, 9), SMOLLM2_LR_3E_3, learning_rate=COSINE_3E_3, val_steps=[0, 8],
                          val_loss=[1.30, 1.28])
  assert still.pattern == "flat", still.report()
  # at 3e-3 the learning rate is not what keeps it still: the fix does not say to raise it
  assert "raise the learning rate" not in still.fix and "above LoRA's usual range" in still.fix, still.fix
  # and one that fell says it learned
  learned = doctor.diagnose(range(1, 9), SMOLLM2_LR_3E_3, learning_rate=COSINE_3E_3, val_steps=[0, 8],
                            val_loss=[1.30, 0.96])
  assert learned.pattern == "healthy", learned.report()


def test_the_expected_mann_kendall_z_of_a_straight_fall():
  """Against simulation: straight falls in Gaussian noise, the mean z over 2000 draws (its standard
  error ~0.02)."""
  rng = np.random.default_rng(0)
  for n, fall, noise in [(8, 0.5, 0.7), (60, 0.85, 1.36), (80, 0.6, 0.29)]:
    t = np.arange(n)
    simulated = np.mean([doctor._mann_kendall_z(-fall * t / (n - 1) + noise * rng.standard_normal(n))
                         for _ in range(2000)])
    assert doctor._mann_kendall_expected_z(n, fall, noise) == pytest.approx(simulated, abs=0.1)
  assert doctor._mann_kendall_expected_z(50, 0.0, 1.0) == 0.0


# 20 steps of those settings (cosine over 20 steps): at lr 1e-3 the loss fell from 2.05 to ~0.3, in
# batches of ~10 trained tokens; at lr 0.01 it jumped to 10 and wandered.
SMOLLM2_20_STEPS_LR_1E_3 = [2.05, 3.171, 1.49, 1.03, 0.912, 2.737, 0.216, 1.669, 0.903, 1.607, 2.094, 0.061, 1.216,
                            0.078, 0.246, 0.577, 1.415, 0.131, 0.325, 0.906]
SMOLLM2_20_STEPS_LR_0_01 = [2.05, 2.618, 3.212, 9.249, 10.396, 7.99, 2.602, 4.634, 7.991, 6.883, 3.104, 5.992, 2.957,
                            5.397, 5.215, 3.876, 3.876, 1.398, 0.685, 6.754]


def test_noise_is_wild_against_the_higher_level_not_a_loss_near_zero():
  """lr 1e-3's batch noise (~0.7 nats) is over twice the level the loss fell to, but a third of where it
  started: against the end level it read "oscillating", whose advice is to lower a learning rate that works."""
  def cosine(lr):
    return [lr * (1 + np.cos(np.pi * i / 20)) / 2 for i in range(20)]

  d = doctor.diagnose(range(1, 21), SMOLLM2_20_STEPS_LR_1E_3, learning_rate=cosine(1e-3), vocab_size=49152)
  assert d.pattern == "too_noisy", d.report()
  assert d.evidence["noise_rel"] == pytest.approx(d.evidence["noise"] / d.evidence["first_level"], rel=1e-3)
  assert d.evidence["noise"] > 2 * d.evidence["last_level"]
  wild = doctor.diagnose(range(1, 21), SMOLLM2_20_STEPS_LR_0_01, learning_rate=cosine(0.01), vocab_size=49152)
  assert wild.pattern == "oscillating" and wild.evidence["noise_rel"] >= doctor.WILD_NOISE_REL, wild.report()


def test_a_still_curve_at_a_usual_learning_rate_is_told_to_train_longer_not_to_raise_it():
  """A 12-step run of 109 per epoch at a constant 2e-4 whose held-out loss moved 3.7%: "raise the
  learning rate (LoRA typically 1e-4 to 3e-4)" would name the range it is in."""
  loss = [1.598, 1.593, 1.895, 1.168, 2.605, 1.179, 1.653, 1.223, 1.505, 1.804, 1.209, 1.645]
  kwargs = dict(val_steps=[0, 12], val_loss=[1.5257, 1.4689], steps_per_epoch=109)
  d = doctor.diagnose(range(1, 13), loss, learning_rate=[2e-4] * 12, **kwargs)
  assert d.pattern == "flat", d.report()
  assert "raise the learning rate" not in d.fix, d.fix
  assert "peaked at 0.0002, in LoRA's usual range" in d.fix and "train longer (12 steps were 11% of one epoch)" in d.fix
  assert d.likely_cause.startswith("too few steps") and "learning rate too low" not in d.likely_cause
  # under the usual range the usual advice stands
  low = doctor.diagnose(range(1, 13), loss, learning_rate=[5e-5] * 12, **kwargs)
  assert low.pattern == "flat" and "raise the learning rate (LoRA typically 1e-4 to 3e-4)" in low.fix, low.fix
  assert low.likely_cause.startswith("learning rate too low")
