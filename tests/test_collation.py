"""The trainer's collation choice (jaxsft.collation.choice): num_buckets / batching auto, and summary.json's
"collation" record of a run with `batching: auto` (tiny model, in process)."""

import json

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


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tokenizer):
  from jaxsft.data import synthetic
  from jaxsft.train import main
  from tiny_model import make_tiny_model_dir

  base = tmp_path_factory.mktemp("auto")
  model = make_tiny_model_dir(base / "model", tokenizer)
  data = synthetic.write_jsonl(synthetic.make_dataset(120, seed=2), base / "tasks.jsonl")
  out = base / "run"
  code = main(["--model", str(model), "--data", str(data), "--output-dir", str(out), "data.batching=auto",
               "data.batch_size=8", "data.tokens_per_batch=none", "data.val_fraction=0", "max_steps=3",
               "eval.eval_every=0", "eval.generate=false", "--no-progress", f"data.cache_dir={base / 'tokens'}"])
  assert code == 0
  return out


@pytest.mark.slow
def test_auto_run_records_its_choice_predicted_and_measured(tiny_run):
  summary = json.loads((tiny_run / "summary.json").read_text())
  record = summary["collation"]
  names = [c["name"] for c in record["candidates"]]
  assert record["choice"] == names[0] and len(names) >= 6
  assert summary["recompiles"] == 0  # the chosen plan's shapes were all compiled before step 1
  for key in ("predicted_seconds", "measured_seconds"):
    assert set(record[key]) == {"steps", "compiles"} and record[key]["steps"] > 0 and record[key]["compiles"] > 0
  assert record["cost"]["source"].startswith("measured") and record["chosen_with"]["source"] == "measured: 3 shapes"
  config = json.loads((tiny_run / "metrics.jsonl").read_text().splitlines()[0])
  chosen = record["candidates"][0]
  assert {tuple(s) for s in config["batch_shapes"]} >= {tuple(s) for s in chosen["shapes"]}
