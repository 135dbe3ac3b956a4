"""data.mix: several sources drawn by weight: proportions, determinism, exact resume, per-source
field maps and counts, the held-out split, and every bad value refused with one error line."""

import json
import pathlib
import re

import numpy as np
import pytest

from jaxsft import config as config_lib
from jaxsft import config_args
from jaxsft import data
from jaxsft.collation import batches as batches_lib
from jaxsft.data import mix as mix_lib
from jaxsft.data import synthetic
from jaxsft.labels import IGNORE_INDEX

MAX_LENGTH = 128


@pytest.fixture(scope="module")
def sources(tokenizer):
  """Three in-memory sources of different sizes (records, tokenized), tokenized once."""
  parts = [synthetic.make_dataset(n, seed=s) for n, s in ((150, 1), (60, 2), (30, 3))]
  return parts, [data.tokenize_records(tokenizer, p, max_length=MAX_LENGTH) for p in parts]


def mixed(sources, weights):
  parts, tokens = sources
  records = mix_lib.MixedRecords(parts)
  return records, mix_lib.concat_tokenized(tokens), mix_lib.Mix(records.sizes, weights)


def batches_of(sources, weights, *, batching="bucketed", seed=0, num_epochs=2, stats=None):
  records, tokens, mix = mixed(sources, weights)
  return batches_lib.make_batches(records, None, max_length=MAX_LENGTH, batching=batching, batch_size=4, seed=seed,
                                  num_epochs=num_epochs, tokenized=tokens, mix=mix, stats=stats)


def same_batches(a, b) -> bool:
  return len(a) == len(b) and all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# Drawing by weight.


def test_proportions_follow_the_weights_over_many_records():
  mix = mix_lib.Mix((3000, 1000, 500), (5, 3, 2))  # relative weights: normalized to 0.5, 0.3, 0.2
  assert mix.weights == pytest.approx((0.5, 0.3, 0.2))
  ds = mix.indices(seed=7)
  n = 3 * mix.epoch_size  # three epochs: later epochs keep the proportions too
  drawn = np.fromiter((mix.source_of(ds[i]) for i in range(n)), dtype=np.int64, count=n)
  assert np.bincount(drawn, minlength=3) / n == pytest.approx([0.5, 0.3, 0.2], abs=0.005)
  for start in range(0, n, 500):  # interleaved, not one source after another
    window = np.bincount(drawn[start:start + 500], minlength=3) / len(drawn[start:start + 500])
    assert window == pytest.approx([0.5, 0.3, 0.2], abs=0.02)


def test_an_epoch_ends_when_the_fewest_records_per_weight_are_used_once():
  mix = mix_lib.Mix((3000, 1000, 500), (5, 3, 2))
  # records / weight: 6000, 3333, 2500: the third source is exhausted first, at 500 / 0.2 positions
  assert mix.epoch_size == 2500
  first = mix.epoch_order(seed=3)
  third = first[first >= 4000]
  assert sorted(third.tolist()) == list(range(4000, 4500))  # each of its records once
  assert len(set(first.tolist())) == len(first)  # nothing repeated within an epoch
  # The next epochs go on where the larger sources stopped: each source's draws, epoch after epoch,
  # read every one of its records once before any again.
  second = mix.epoch_order(seed=3, epoch=1)
  both = np.concatenate([first, second])
  assert (both < 3000).sum() == len(set(both[both < 3000].tolist())) == 2500  # 1,250 an epoch of its 3,000, none repeated
  middle = both[(both >= 3000) & (both < 4000)]
  assert len(middle) == 1500 and sorted(middle[:1000].tolist()) == list(range(3000, 4000))
  assert sorted(second[second >= 4000].tolist()) == list(range(4000, 4500))  # its second pass, reshuffled
  assert not np.array_equal(second[second >= 4000], third)


def test_the_pipeline_draws_by_weight_and_counts_each_source(sources):
  stats = data.PipelineStats()
  out = list(batches_of(sources, (0.6, 0.3, 0.1), stats=stats))
  _, tokens, mix = mixed(sources, (0.6, 0.3, 0.1))
  assert stats.examples == 2 * mix.epoch_size
  assert np.array(stats.source_examples) / stats.examples == pytest.approx([0.6, 0.3, 0.1], abs=0.01)
  # The counts add up to the pipeline's totals, and the trained tokens are those of the batches made.
  assert sum(stats.source_examples) == stats.examples
  assert sum(stats.source_trained_tokens) == stats.label_tokens == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in out)
  assert [int(b["epoch"]) for b in out] == sorted(int(b["epoch"]) for b in out)
  assert batches_lib.count_batches(tokens, max_length=MAX_LENGTH, batching="bucketed", batch_size=4, mix=mix) == sum(
      int(b["epoch"]) == 0 for b in out)


@pytest.mark.parametrize("batching", ["packed", "bucketed_packed"])
def test_packed_batches_count_each_segment_for_its_source(sources, batching):
  stats = data.PipelineStats()
  out = list(batches_of(sources, (1, 1, 1), batching=batching, stats=stats))
  assert len(stats.source_trained_tokens) == 3 and min(stats.source_trained_tokens) > 0
  assert sum(stats.source_trained_tokens) == stats.label_tokens == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in out)


def test_trained_tokens_are_split_by_segment():
  labels = np.array([[5, 6, IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX], [1, 2, 3, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
  segments = np.array([[1, 1, 2, 2, 3, 3, 0], [1, 1, 1, 0, 0, 0, 0]])
  got = data.pipeline_stats.trained_by_source({"labels": labels, "segment_ids": segments}, [[0, 2, 0], [1]])
  assert got == {0: 2 + 2, 2: 1, 1: 3}
  assert data.pipeline_stats.trained_by_source({"labels": labels}, [[2], [2]]) == {2: 8}


# ---------------------------------------------------------------------------------------------
# Determinism and resume.


def test_the_same_seed_gives_the_same_batches_and_another_seed_others(sources):
  first = list(batches_of(sources, (0.7, 0.3, 0.2), seed=5))
  assert same_batches(first, list(batches_of(sources, (0.7, 0.3, 0.2), seed=5)))
  assert not same_batches(first, list(batches_of(sources, (0.7, 0.3, 0.2), seed=6)))


@pytest.mark.parametrize("batching,stop_after", [("bucketed", 9), ("bucketed", 40), ("packed", 7), ("bucketed_packed", 11)])
def test_resume_mid_mix_gives_the_same_next_batches_and_counts(sources, batching, stop_after):
  straight_stats = data.PipelineStats()
  straight = list(batches_of(sources, (0.5, 0.3, 0.2), batching=batching, stats=straight_stats))
  assert len(straight) > stop_after
  stats = data.PipelineStats()
  it = iter(batches_of(sources, (0.5, 0.3, 0.2), batching=batching, stats=stats))
  for _ in range(stop_after):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # checkpoints store JSON
  counts = json.loads(json.dumps(dict(source_examples=stats.source_examples,
                                      source_trained_tokens=stats.source_trained_tokens)))
  resumed_stats = data.PipelineStats(**counts, examples=stats.examples, label_tokens=stats.label_tokens)
  restored = iter(batches_of(sources, (0.5, 0.3, 0.2), batching=batching, stats=resumed_stats))
  restored.set_state(state)
  assert same_batches(list(restored), straight[stop_after:])
  assert resumed_stats.source_trained_tokens == straight_stats.source_trained_tokens
  assert sum(resumed_stats.source_examples) == resumed_stats.examples
  if batching != "packed":  # grain's packer re-reads the examples of its open rows on restore: `examples` counts them again
    assert resumed_stats.source_examples == straight_stats.source_examples


# ---------------------------------------------------------------------------------------------
# The config: data.mix on the command line and in YAML, and its refusals.


def test_the_command_line_takes_path_weight_pairs_and_the_overrides_after_them():
  cfg = config_args.parse_args(["--data.mix", "a.json=0.7", "b.jsonl=0.3", "max_steps=5", "--lr", "1e-3"])
  assert [(s.path, s.weight) for s in cfg.data.mix] == [("a.json", 0.7), ("b.jsonl", 0.3)]
  assert cfg.max_steps == 5 and cfg.optim.lr == 1e-3 and cfg.data.path is None
  cfg = config_args.parse_args(["data.mix=a=b.json=2,c.json=1"])  # the last '=' splits: a path may hold one
  assert [(s.path, s.weight) for s in cfg.data.mix] == [("a=b.json", 2.0), ("c.json", 1.0)]


def test_yaml_sources_keep_their_own_field_map_and_format(tmp_path):
  path = tmp_path / "mix.yaml"
  path.write_text("data:\n  mix:\n    - {path: a.jsonl, weight: 3}\n"
                  "    - {path: qa.jsonl, weight: 1, field_map: {instruction: question, output: answer}, format: alpaca}\n"
                  "    - b.jsonl=0.5\n")
  mix = config_lib.load_yaml(path).data.mix
  assert [(s.path, s.weight, s.field_map, s.format) for s in mix] == [
      ("a.jsonl", 3.0, None, "auto"), ("qa.jsonl", 1.0, {"instruction": "question", "output": "answer"}, "alpaca"),
      ("b.jsonl", 0.5, None, "auto")]
  assert config_lib.from_dict(config_lib.to_dict(config_lib.load_yaml(path))).data.mix == mix  # config.json reads back


@pytest.mark.parametrize("spec,message", [
    (["a.jsonl=0"], "data.mix: a.jsonl: weight must be a finite number > 0, got 0.0"),
    (["a.jsonl=-1"], "data.mix: a.jsonl: weight must be a finite number > 0, got -1.0"),
    (["a.jsonl=nan"], "data.mix: a.jsonl: weight must be a finite number > 0, got nan"),
    (["a.jsonl=inf"], "data.mix: a.jsonl: weight must be a finite number > 0, got inf"),
    (["a.jsonl"], "data.mix: 'a.jsonl' is not PATH=WEIGHT"),
    (["a.jsonl=heavy"], "data.mix: a.jsonl: weight: 'heavy' is not a valid float"),
    (["=0.5"], "data.mix: '=0.5' is not PATH=WEIGHT"),
    (["a.jsonl=1", "./a.jsonl=2"], "data.mix: ./a.jsonl is given twice (also as a.jsonl)"),
])
def test_each_bad_value_is_one_error_line_naming_the_source(spec, message, train_main, tiny_dir, tmp_path):
  from test_faults import only_error_line

  out = tmp_path / "never"
  r = train_main(["--model", tiny_dir, "--output-dir", out, "--data.mix", *spec])
  assert r.returncode == 2
  assert only_error_line(r.stderr).startswith(f"error: {message}")
  assert not out.exists()


def test_a_missing_file_and_data_path_beside_data_mix_are_refused_before_anything_loads(
    train_main, tiny_dir, small_data, tmp_path):
  from test_faults import only_error_line

  out = tmp_path / "never"
  r = train_main(["--model", tiny_dir, "--output-dir", out, "--data.mix", f"{small_data}=1", f"{tmp_path}/gone.jsonl=1"])
  assert r.returncode == 2
  assert only_error_line(r.stderr) == f"error: data.mix: {tmp_path}/gone.jsonl: no such file or folder"
  r = train_main(["--model", tiny_dir, "--output-dir", out, "--data", small_data, "--data.mix", f"{small_data}=1"])
  assert r.returncode == 2
  assert only_error_line(r.stderr).startswith(f"error: data.mix and data.path are both set (data.path={small_data})")
  assert not out.exists()


# ---------------------------------------------------------------------------------------------
# A run's data.


def qa_file(tmp_path, shared_data, n=40) -> pathlib.Path:
  """The first `n` grade-school maths questions: {question, answer}, readable only with a field map."""
  lines = (shared_data / "gsm8k_test.jsonl").read_text().splitlines()[:n]
  path = tmp_path / "qa.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return path


def test_each_source_is_read_with_its_own_field_map_and_holds_out_its_own_records(tmp_path, small_data, shared_data):
  from jaxsft.train.data_plan import load_data

  qa = qa_file(tmp_path, shared_data)
  cfg = config_lib.from_dict({"data": {
      "mix": [{"path": str(small_data), "weight": 3},
              {"path": str(qa), "weight": 1, "field_map": {"instruction": "question", "output": "answer"}}],
      "val_fraction": 0.1, "max_val_examples": 8}})
  train, held_out = load_data(cfg)
  assert train.sizes == (160 - 4, 40 - 4)  # round(10%) of each, at most 8 / 2 sources
  questions = {json.loads(line)["question"] for line in qa.read_text().splitlines()}
  from_qa = [r for r in held_out if r["messages"][0]["content"] in questions]
  assert len(held_out) == 8 and len(from_qa) == 4
  last = train[len(train) - 1]  # a qa record, read through its field map
  assert last["messages"][0]["content"] in questions and last["messages"][-1]["role"] == "assistant"
  # Without its field map the same file is refused, naming it.
  cfg.data.mix[1].field_map = None
  with pytest.raises(data.DataError, match="qa.jsonl"):
    load_data(cfg)


@pytest.mark.slow
def test_a_mixed_run_resumes_exactly_and_its_summary_counts_add_up(tiny_dir, small_data, shared_data, tmp_path, train_main):
  from test_train import DETERMINISTIC, read_metrics

  qa = qa_file(tmp_path, shared_data, n=60)
  (tmp_path / "mix.yaml").write_text(json.dumps({"data": {"mix": [
      {"path": str(small_data), "weight": 0.7},
      {"path": str(qa), "weight": 0.3, "field_map": {"instruction": "question", "output": "answer"}}]}}))

  def run(out, *extra):
    r = train_main(["--config", tmp_path / "mix.yaml", "--model", tiny_dir, "--output-dir", out, "--lr", "2e-3",
                    "data.num_buckets=2", "data.batch_size=8", "data.max_length=256", "data.max_val_examples=8",
                    "data.time_shapes=false", "optim.schedule=constant", "optim.warmup_steps=0", "eval.eval_every=0",
                    "eval.generate=false", "save_every=3", "--no-progress", *extra])
    assert r.returncode == 0, r.stderr
    return json.loads((out / "summary.json").read_text())

  straight = run(tmp_path / "straight", "max_steps=6")
  run(tmp_path / "resumed", "max_steps=3")
  resumed = run(tmp_path / "resumed", "max_steps=6", "--resume")
  a, b = read_metrics(tmp_path / "straight")[0], read_metrics(tmp_path / "resumed")[0]
  assert [l["step"] for l in b] == list(range(1, 7))
  for x, y in zip(a, b):
    assert {k: x[k] for k in DETERMINISTIC} == {k: y[k] for k in DETERMINISTIC}
  sources = straight["data_sources"]
  assert [(s["path"], s["weight"], s["share"]) for s in sources] == [(str(small_data), 0.7, 0.7), (str(qa), 0.3, 0.3)]
  assert resumed["data_sources"] == sources and resumed["data"] == straight["data"]
  examples = int(straight["data"].split()[0])  # "N examples (...)": the pipeline's total
  assert sum(s["examples"] for s in sources) == examples and min(s["examples"] for s in sources) > 0
  assert sources[0]["examples"] / examples == pytest.approx(0.7, abs=0.1)
  # The counts are those of the 6 batches the steps trained on, not of the ones read ahead: every
  # row starts with an untrained prompt token, so the labels != -100 are the loss's valid tokens.
  assert sum(s["trained_tokens"] for s in sources) == sum(l["valid_tokens"] for l in a) > 0
  batches, padded = re.search(r"(\d+) batches, .* (\d+) padded tokens", straight["data"]).groups()
  assert (int(batches), int(padded)) == (6, sum(l["tokens"] for l in a))
