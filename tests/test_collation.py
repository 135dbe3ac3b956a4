"""The trainer's collation choice (jaxsft.collation.choice): num_buckets / batching auto. summary.json's
"collation" record of a run with `batching: auto` is checked in test_compiles.py, on its cold run."""

import numpy as np
import pytest

from jaxsft import config as config_lib
from jaxsft.collation import choice as collation
from jaxsft.collation.cost import StepCost


def lengths(n=300, seed=0):
  return np.clip(np.random.default_rng(seed).lognormal(5.0, 0.7, n).astype(int), 8, 512)


def test_num_buckets_auto_buys_buckets_with_run_length():
  dear_compiles = StepCost(a=0.05, b=1e-3, c=1e-7, compile_base=20.0)
  counts = {}
  for epochs in (1, 100):
    cfg = config_lib.apply_overrides(config_lib.TrainConfig(), {"data.num_buckets": "auto", "epochs": epochs})
    choice = collation.choose(cfg, lengths(), num_train=300, max_length=512, batch_size_for=lambda t: 8,
                              cost=dear_compiles)
    counts[epochs] = len(choice.batching["bucket_lengths"])
    assert choice.batching["batching"] == "bucketed" and choice.batching["bucket_lengths"][-1] == 512
  assert 1 <= counts[1] < counts[100] <= collation.MAX_AUTO_BUCKETS


def test_auto_picks_the_cheapest_candidate_and_lists_the_others():
  cfg = config_lib.apply_overrides(config_lib.TrainConfig(), {"data.batching": "auto"})
  choice = collation.choose(cfg, lengths(), num_train=300, max_length=512, batch_size_for=lambda t: 8,
                            cost=StepCost(a=0.05, b=1e-3, c=1e-5))
  totals = [c.predicted.total for c in choice.candidates]
  assert totals == sorted(totals) and choice.name == choice.candidates[0].name
  assert {c.name for c in choice.candidates} >= {"static", "dynamic", "packed", "bucketed auto", "bucketed K=4",
                                                 "bucketed_packed auto"}
  # Free compiles and attention dearer than the rest at T = 512: narrow rows beat one width of 512.
  assert choice.batching["batching"] in ("bucketed", "bucketed_packed", "dynamic")
  cheap_attention = collation.choose(cfg, lengths(), num_train=300, max_length=512, batch_size_for=lambda t: 8,
                                     cost=StepCost(a=0.05, b=1e-3, c=0.0, compile_base=30.0))
  # Dear compiles, tokens all that counts: rows of one width, packed (by the width packer's best fit,
  # which fills them denser than packed mode's first fit does).
  assert cheap_attention.batching == {"batching": "bucketed_packed", "bucket_lengths": [512], "num_buckets": 1}


def test_timed_shapes_spread_over_the_widths():
  shapes = [(8, t) for t in range(8, 520, 8)]
  picked = collation.timed_shapes(shapes, 6)
  assert len(picked) == 6 and picked[0] == (8, 8) and picked[-1] == (8, 512)
  assert collation.timed_shapes(shapes[:3]) == shapes[:3]
  assert collation.probe_widths(344, 8) == [88, 176, 344]


def test_a_resumed_collation_is_kept_where_jaxsft_chose_it_and_refused_where_the_config_fixes_another():
  from jaxsft.collation import planner

  first = {"batching": "bucketed_packed", "bucket_lengths": [96, 256], "max_length": 256}

  def kept(**data):
    cfg = config_lib.TrainConfig()
    for key, value in data.items():
      setattr(cfg.data, key, value)
    return planner.resolved(planner.keep_resumed(cfg.data, planner.base_batching(cfg.data, 1), first))

  assert kept(batching="auto") == kept(batching="bucketed_packed", max_length=512) == first
  assert kept(batching="bucketed_packed", bucket_lengths=(96, 256), max_length=256) == first
  for changed in ({"batching": "static"}, {"batching": "auto", "max_length": 128},
                  {"batching": "bucketed_packed", "bucket_lengths": (128, 256), "max_length": 256}):
    with pytest.raises(config_lib.ConfigError, match=r"--resume: .* bucketed_packed \[96, 256\] at max_length 256"):
      kept(**changed)
