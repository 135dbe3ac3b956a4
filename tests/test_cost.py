"""The collation cost model (jaxsft.collation.cost) and the cost-aware bucket DP (choose_buckets with
batch sizes, fill rows, T-dependent step cost and priced compiles)."""

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from jaxsft.collation.buckets import choose_buckets
from jaxsft.collation.cost import (PADDED_TOKENS, PlanSeconds, StepCost, epochs_planned, fit_step_cost,
                                   plan_seconds)


def test_fit_recovers_the_cost_of_exact_samples():
  true = StepCost(a=0.05, b=2e-4, c=3e-7)
  shapes = [(8, 64), (8, 256), (8, 1024), (4, 512), (16, 128)]
  fitted = fit_step_cost([(b, t, float(true.step_seconds(b, t))) for b, t in shapes],
                         [(b, t, 1.0 + 2e-3 * t) for b, t in shapes])
  np.testing.assert_allclose([fitted.a, fitted.b, fitted.c], [true.a, true.b, true.c], rtol=1e-6)
  np.testing.assert_allclose([fitted.compile_base, fitted.compile_per_width], [1.0, 2e-3], rtol=1e-6)
  assert fitted.source == "measured: 5 shapes"
  # Exact samples leave nothing to correct: r(T) = 1 at every timed width.
  np.testing.assert_allclose([r for _, r in fitted.step_ratios + fitted.compile_ratios], 1.0, rtol=1e-6)


def test_every_timed_width_costs_what_it_measured_and_the_cost_survives_json():
  # A step whose time jumps between 256 and 512 (as a CPU's does past a cache size): no three-term
  # fit passes through all six, the correction makes each timed width cost its measurement.
  measured = {32: 0.9, 64: 1.6, 128: 3.4, 256: 6.9, 512: 17.7, 1024: 41.2}
  compiled = {32: 6.3, 64: 2.9, 128: 3.4, 256: 4.2, 512: 5.8, 1024: 9.4}
  fitted = fit_step_cost([(8, t, s) for t, s in measured.items()], [(8, t, s) for t, s in compiled.items()])
  smooth = StepCost(fitted.a, fitted.b, fitted.c, fitted.compile_base, fitted.compile_per_width)
  assert max(abs(float(smooth.step_seconds(8, t)) / s - 1) for t, s in measured.items()) > 0.02  # the fit alone misses
  for t, s in measured.items():
    assert float(fitted.step_seconds(8, t)) == pytest.approx(s, rel=1e-9)
    assert float(fitted.compile_seconds(8, t)) == pytest.approx(compiled[t], rel=1e-9)
  # Between two timed widths r is linear; past the ends it holds the end's ratio; B scales the fit.
  r = dict(fitted.step_ratios)
  mid = float(fitted.step_seconds(8, 384)) / float(smooth.step_seconds(8, 384))
  assert mid == pytest.approx((r[256] + r[512]) / 2, rel=1e-9)
  assert float(fitted.step_seconds(4, 2048)) == pytest.approx(float(smooth.step_seconds(4, 2048)) * r[1024], rel=1e-9)
  assert float(fitted.step_seconds(8, 16)) == pytest.approx(float(smooth.step_seconds(8, 16)) * r[32], rel=1e-9)
  widths = np.array([64, 300, 1024])  # arrays broadcast as before
  np.testing.assert_allclose(fitted.step_seconds(8, widths), [float(fitted.step_seconds(8, int(t))) for t in widths])
  # summary.json keeps the cost; `jaxsft.data stats --cost-from` rebuilds it from the lists JSON gives.
  again = StepCost(**json.loads(json.dumps(fitted.to_dict())))
  assert again == fitted and float(again.step_seconds(8, 300)) == float(fitted.step_seconds(8, 300))


def test_fit_uses_fewer_terms_when_shapes_cannot_tell_them_apart():
  one = fit_step_cost([(8, 128, 2.0), (8, 128, 2.2)], [(8, 128, 3.0)])
  assert one.a == 0 and one.c == 0 and one.b == pytest.approx(2.1 / 1024)  # proportional to tokens
  assert one.compile_base == 3.0 and one.compile_per_width == 0
  two = fit_step_cost([(8, 128, 1.5), (8, 256, 2.5)])
  assert two.c == 0 and two.a == pytest.approx(0.5) and two.b == pytest.approx(1.0 / 1024)
  assert two.compile_seconds(8, 512) == 0  # no compile timings: compiles priced at zero
  with pytest.raises(ValueError, match="at least one"):
    fit_step_cost([])


def test_fit_never_returns_negative_coefficients():
  # Noisy timings whose plain least squares would give a negative intercept.
  fitted = fit_step_cost([(8, 32, 0.01), (8, 64, 0.5), (8, 512, 4.0), (8, 1024, 8.2)])
  assert min(fitted.a, fitted.b, fitted.c) >= 0


def test_plan_seconds_sums_steps_over_epochs_and_compiles_once():
  cost = StepCost(a=1.0, b=0.0, c=0.0, compile_base=10.0)
  got = plan_seconds(cost, {(8, 64): 3, (4, 128): 2}, [(8, 64), (4, 128)], epochs=2)
  assert got == PlanSeconds(steps=10.0, compiles=20.0) and got.total == 30.0
  assert epochs_planned(40, epochs=3, max_steps=None) == 3.0
  assert epochs_planned(40, epochs=3, max_steps=10, grad_accum=2) == 0.5


# ---------------------------------------------------------------------------------------------
# The DP.


def plan_cost(lengths, bounds, size_of, cost=PADDED_TOKENS, *, epochs=1.0, price_compiles=False):
  """Σ over buckets of epochs·ceil(n/B)·step(B, T) (+ compiles): what a bucket plan costs."""
  bounds = sorted(bounds)
  index = np.searchsorted(bounds, lengths)
  total = 0.0
  for k, t in enumerate(bounds):
    n, b = int((index == k).sum()), size_of(t)
    if n:
      total += epochs * math.ceil(n / b) * float(cost.step_seconds(b, t))
      total += float(cost.compile_seconds(b, t)) if price_compiles else 0.0
  return total


def brute_force(lengths, num_buckets, size_of, cost=PADDED_TOKENS, **kw):
  """The least plan cost over every set of at most num_buckets boundaries ending at the maximum."""
  values = sorted(set(lengths))
  best = math.inf
  for k in range(num_buckets):
    for inner in itertools.combinations(values[:-1], k):
      best = min(best, plan_cost(lengths, list(inner) + [values[-1]], size_of, cost, **kw))
  return best


def test_fill_rows_change_the_optimum_where_partial_batches_matter():
  # Four of 8, one of 16, four of 32, batches of 4: per-example padding prefers [8, 32] (192 tokens
  # padded) but its 32-bucket holds five examples: two batches, three fill rows (288 with them).
  # [16, 32] pads more per example (208) but fills every batch but one: 256 with fill rows.
  lengths = [8] * 4 + [16] + [32] * 4
  old = choose_buckets(lengths, 2, multiple_of=8)
  new = choose_buckets(lengths, 2, multiple_of=8, batch_size=4)
  assert old == [8, 32] and new == [16, 32]
  size = lambda t: 4  # noqa: E731
  assert plan_cost(lengths, new, size) == 256 < plan_cost(lengths, old, size) == 288


@pytest.mark.parametrize("seed", range(6))
def test_fill_row_aware_boundaries_are_optimal_and_never_worse_than_the_padding_only_dp(seed):
  rng = np.random.default_rng(seed)
  lengths = (rng.integers(1, 13, size=int(rng.integers(5, 40))) * 8).tolist()  # at most 12 distinct values
  batch = int(rng.integers(2, 9))
  size = lambda t: batch  # noqa: E731
  for k in (1, 2, 3, 4):
    new = choose_buckets(lengths, k, multiple_of=8, batch_size=batch)
    old = choose_buckets(lengths, k, multiple_of=8)
    assert len(new) <= k and max(new) == max(lengths)
    assert plan_cost(lengths, new, size) == brute_force(lengths, k, size)
    assert plan_cost(lengths, new, size) <= plan_cost(lengths, old, size)


@pytest.mark.parametrize("seed", range(4))
def test_token_budget_and_attention_cost_are_optimal(seed):
  rng = np.random.default_rng(100 + seed)
  lengths = (rng.integers(1, 11, size=30) * 32).tolist()
  budget = lambda t: max(4096 // t, 1)  # noqa: E731  B_k = tokens_per_batch // T_k
  cost = StepCost(a=0.3, b=1e-3, c=4e-6)  # attention a large share: a padded token at T=320 costs 2.3x one at 32
  for k in (2, 3):
    got = choose_buckets(lengths, k, multiple_of=32, batch_size=budget, cost=cost, epochs=3)
    assert plan_cost(lengths, got, budget, cost, epochs=3) == pytest.approx(brute_force(lengths, k, budget, cost,
                                                                                         epochs=3))


def test_priced_compiles_choose_how_many_buckets():
  rng = np.random.default_rng(7)
  lengths = (rng.integers(1, 17, size=200) * 16).tolist()
  size = lambda t: 8  # noqa: E731
  results = {}
  for compile_s, epochs in ((0.0, 1), (30.0, 1), (30.0, 50)):
    cost = StepCost(a=0.05, b=1e-3, c=1e-7, compile_base=compile_s)
    got = choose_buckets(lengths, 16, multiple_of=16, batch_size=8, cost=cost, epochs=epochs, price_compiles=True)
    assert plan_cost(lengths, got, size, cost, epochs=epochs, price_compiles=True) == pytest.approx(
        min(plan_cost(lengths, choose_buckets(lengths, k, multiple_of=16, batch_size=8, cost=cost, epochs=epochs),
                      size, cost, epochs=epochs, price_compiles=True) for k in range(1, 17)))
    results[(compile_s, epochs)] = len(got)
  # Free compiles: many buckets; dear compiles: fewer; a longer run buys back more of them.
  assert results[(30.0, 1)] < results[(30.0, 50)] <= results[(0.0, 1)]


def test_batches_per_shape_counts_what_the_pipeline_emits(tokenizer):
  """The cost model's batch counts per shape are the pipeline's, for every mode (one epoch, the
  records' order)."""
  import collections

  from jaxsft.data import make_batches, synthetic, tokenize_records
  from jaxsft.collation.plans import batches_per_shape, packed_batches_per_shape

  records = synthetic.make_dataset(60, seed=4)
  tokens = tokenize_records(tokenizer, records, max_length=128)
  lengths = tokens.lengths
  for batching, buckets in (("static", None), ("dynamic", None), ("bucketed", [48, 80, 128]), ("packed", None),
                            ("bucketed_packed", [64, 128])):
    emitted = collections.Counter(b["input_ids"].shape for b in make_batches(
        records, tokenizer, max_length=128, batching=batching, bucket_lengths=buckets, batch_size=4, shuffle=False,
        tokenized=tokens))
    per_shape, shapes = batches_per_shape(batching, lengths, max_length=128, batch_size_for=lambda t: 4,
                                          bucket_lengths=buckets)
    assert per_shape == dict(emitted), batching
    assert set(per_shape) <= set(shapes)
  # Packed mode is grain's first-fit into B rows sent out together, not the width packer's best fit
  # over 2·B open rows: on 80 examples in rows of 160, 4 a batch, grain makes 10 batches, best fit 9.
  records = synthetic.make_dataset(80, seed=4)
  tokens = tokenize_records(tokenizer, records, max_length=160)
  emitted = collections.Counter(b["input_ids"].shape for b in make_batches(
      records, tokenizer, max_length=160, batching="packed", batch_size=4, shuffle=False, tokenized=tokens))
  assert batches_per_shape("packed", tokens.lengths, max_length=160, batch_size_for=lambda t: 4)[0] == dict(emitted)
  assert sum(packed_batches_per_shape(tokens.lengths, [160], lambda t: 4).values()) != sum(emitted.values())


def test_packing_widths_chosen_on_a_sample_of_many_lengths_are_the_full_choice():
  """Past `sample` lengths the width search simulates a seeded sample, its steps scaled to all: on
  lengths with the same mix throughout it picks what simulating every length picks, and the widest
  width still holds the one longest example, which the sample does not contain."""
  from jaxsft.collation.plans import choose_packing_widths
  from jaxsft.collation.cost import DEFAULT_COST

  rng = np.random.default_rng(1)
  mix = np.concatenate([rng.integers(20, 100, 300), rng.integers(400, 1000, 60)])
  lengths = np.tile(mix, 60)[rng.permutation(len(mix) * 60)]
  lengths[5] = 1017
  common = dict(batch_size_for=lambda t: 8, cost=DEFAULT_COST, max_length=1024, price_compiles=True)
  every = choose_packing_widths(lengths, 4, sample=len(lengths), **common)
  sampled = choose_packing_widths(lengths, 4, sample=4_000, **common)
  assert sampled == every and every[-1] == 1024 and len(every) > 1


def test_packing_widths_pad_at_most_two_points_more_than_packing():
  """Short examples of 60-160 tokens and a few of 400-470: the cheapest widths under the default cost
  pad over two points more than packing into rows of max_length; the chosen widths keep within the
  two points, cost no less than the cheapest and less than packing; and a bound the cheapest widths
  keep to leaves them the choice."""
  from jaxsft.collation.plans import MAX_EXTRA_WASTE_POINTS, choose_packing_widths, packed_batches_per_shape, padding_waste
  from jaxsft.collation.cost import DEFAULT_COST

  rng = np.random.default_rng(1)
  lengths = np.concatenate([rng.integers(60, 160, 248), rng.integers(400, 470, 8)])[rng.permutation(256)]
  common = dict(batch_size_for=lambda t: 8, cost=DEFAULT_COST, max_length=1024)

  def waste_and_seconds(widths):
    per_shape = packed_batches_per_shape(lengths, widths, common["batch_size_for"])
    return padding_waste(lengths, per_shape), plan_seconds(DEFAULT_COST, per_shape, []).total

  packing_waste, packing_seconds = waste_and_seconds([1024])
  cheapest = choose_packing_widths(lengths, 4, max_extra_waste=float("inf"), **common)
  chosen = choose_packing_widths(lengths, 4, **common)
  assert waste_and_seconds(cheapest)[0] > packing_waste + MAX_EXTRA_WASTE_POINTS  # the bound matters here
  waste, seconds = waste_and_seconds(chosen)
  assert len(chosen) >= 2 and waste <= packing_waste + MAX_EXTRA_WASTE_POINTS, (chosen, waste, packing_waste)
  assert waste_and_seconds(cheapest)[1] <= seconds < packing_seconds
  assert choose_packing_widths(lengths, 4, max_extra_waste=waste_and_seconds(cheapest)[0] - packing_waste + 1e-9,
                               **common) == cheapest


def test_the_cost_model_and_the_bucket_choice_import_without_jax():
  """The pipeline chooses buckets with them, and `python -m jaxsft.data stats` prices plans: pure
  numpy, nothing of the step or the collation's entry point comes with them."""
  check = ("'jax' not in sys.modules and 'jaxsft.data' not in sys.modules and "
           "'jaxsft.collation.planner' not in sys.modules")
  subprocess.run([sys.executable, "-c", f"import sys, jaxsft.collation.cost, jaxsft.collation.buckets; "
                  f"assert {check}, sorted(sys.modules)"], check=True)
