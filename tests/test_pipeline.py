"""make_batches / batch_shapes / count_batches: shapes, epochs, drops, packing, determinism, exact
resume, batch counts, and one TokenizedRecords serving every call. Through `jaxsft.collation`'s
entry points, which are jaxsft.data's with the buckets chosen where none are given."""

import json

import numpy as np
import pytest

from jaxsft import data
from jaxsft.collation.batches import batch_shapes, count_batches, make_batches
from jaxsft.data import IGNORE_INDEX, DataError, PipelineStats, load_records, tokenize_records

MAX_LENGTH = 256


@pytest.fixture(scope="module")
def records(shared_data):
  alpaca = load_records(shared_data / "alpaca_en_demo.json")
  chat = load_records(shared_data / "chat_multiturn_demo.json")
  return list(alpaca[:150]) + list(chat[:50])


@pytest.fixture(scope="module")
def tokens(records, tokenizer):
  return tokenize_records(tokenizer, records, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def examples(tokens):
  return tokens.examples


def rows_of(batches):
  """The real (non-fill) rows of batches as (input_ids, labels) tuples."""
  out = []
  for b in batches:
    for ids, mask, labels in zip(b["input_ids"], b["attention_mask"], b["labels"]):
      n = int(mask.sum())
      if n:
        out.append((tuple(ids[:n].tolist()), tuple(labels[:n].tolist())))
  return out


def as_key(example):
  return tuple(example["input_ids"].tolist()), tuple(example["labels"].tolist())


@pytest.mark.parametrize("batching", ["bucketed", "dynamic", "static"])
def test_every_example_once_per_epoch_in_listed_shapes(records, tokenizer, examples, batching):
  stats = PipelineStats()
  config = dict(max_length=MAX_LENGTH, batching=batching, batch_size=8, num_epochs=2)
  batches = list(make_batches(records, tokenizer, stats=stats, **config))
  shapes = batch_shapes(records, tokenizer, **config)
  kept = sorted(as_key(e) for e in examples if e is not None)
  for epoch in (0, 1):
    assert sorted(rows_of([b for b in batches if b["epoch"] == epoch])) == kept  # nothing lost or repeated
  for b in batches:
    assert b["input_ids"].shape in shapes and b["input_ids"].dtype == np.int32
    assert set(b) == {"input_ids", "attention_mask", "labels", "epoch"} and b["epoch"].shape == ()
    fill = b["attention_mask"].sum(axis=1) == 0
    assert (b["labels"][fill] == IGNORE_INDEX).all() and (b["input_ids"][fill] == tokenizer.pad_token_id).all()
  assert [int(b["epoch"]) for b in batches] == sorted(int(b["epoch"]) for b in batches)
  assert stats.examples == 2 * len(records) and stats.batches == len(batches)
  assert stats.truncated > 0 and stats.dropped == 2 * sum(e is None for e in examples)
  assert stats.label_tokens == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
  if batching == "bucketed":
    assert len(shapes) == 8 and shapes[-1][1] == MAX_LENGTH


def test_drops_are_counted(records, tokenizer):
  stats = PipelineStats()
  short = tokenize_records(tokenizer, records, max_length=40).examples
  batches = list(make_batches(records, tokenizer, max_length=40, bucket_lengths=[16, 32, 40], stats=stats))
  dropped = sum(e is None for e in short)
  assert dropped > 0 and stats.dropped == dropped == stats.dropped_per_epoch[0]
  assert len(rows_of(batches)) == len(records) - dropped


def test_token_budget_and_batch_multiple(records, tokenizer):
  config = dict(max_length=MAX_LENGTH, bucket_lengths=[64, 128, 200, 256], tokens_per_batch=1000,
                batch_multiple_of=2)
  shapes = batch_shapes(records, tokenizer, **config)
  assert shapes == [(2, 256), (4, 200), (6, 128), (14, 64)]  # 1000 // T rounded down to a multiple of 2
  for b in make_batches(records, tokenizer, **config):
    assert b["input_ids"].shape in shapes


def test_reshuffles_each_epoch_and_is_deterministic(records, tokenizer):
  config = dict(max_length=MAX_LENGTH, batching="dynamic", batch_size=4, num_epochs=2, seed=3)
  first = list(make_batches(records, tokenizer, **config))
  again = list(make_batches(records, tokenizer, **config))
  assert all((a[k] == b[k]).all() for a, b in zip(first, again) for k in a) and len(first) == len(again)
  epoch0 = rows_of([b for b in first if b["epoch"] == 0])
  epoch1 = rows_of([b for b in first if b["epoch"] == 1])
  assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)
  other = rows_of(make_batches(records, tokenizer, **{**config, "seed": 4, "num_epochs": 1}))
  assert other != epoch0


def test_repeat_forever(records, tokenizer):
  it = iter(make_batches(records, tokenizer, max_length=MAX_LENGTH, batch_size=16, num_epochs=None))
  epochs = {int(next(it)["epoch"]) for _ in range(60)}
  assert epochs >= {0, 1, 2}


def test_packed(records, tokenizer, examples):
  stats = PipelineStats()
  batches = list(make_batches(records, tokenizer, max_length=MAX_LENGTH, batching="packed", batch_size=4,
                              stats=stats))
  assert batch_shapes(records, tokenizer, max_length=MAX_LENGTH, batching="packed", batch_size=4) == [(4, MAX_LENGTH)]
  segments = []
  for b in batches:
    assert b["input_ids"].shape == (4, MAX_LENGTH)
    seg, pos = b["segment_ids"], b["positions"]
    np.testing.assert_array_equal(b["attention_mask"], (seg > 0).astype(np.int32))
    assert (b["input_ids"][seg == 0] == tokenizer.pad_token_id).all() and (b["labels"][seg == 0] == IGNORE_INDEX).all()
    assert (pos[seg == 0] == 0).all() and (b["labels"][(pos == 0)] == IGNORE_INDEX).all()
    for row in range(4):
      for s in range(1, seg[row].max() + 1):
        at = np.flatnonzero(seg[row] == s)
        assert (np.diff(at) == 1).all() and pos[row, at].tolist() == list(range(len(at)))
        segments.append((tuple(b["input_ids"][row, at].tolist()), tuple(b["labels"][row, at[1:]].tolist())))
  expected = sorted((k[0], k[1][1:]) for k in map(as_key, (e for e in examples if e is not None)))
  assert sorted(segments) == expected  # every example packed once; only its first label is masked
  assert stats.padded_tokens == len(batches) * 4 * MAX_LENGTH


@pytest.mark.parametrize("extra", [{}, {"bucket_lengths": [64, 128, 128, 256]}])  # a repeated width is one
def test_bucketed_packing(records, tokenizer, examples, extra):
  """Rows of a few widths (`rows.WidthPacker`): every example once per epoch, as a whole segment with
  restarted positions in a row at least as wide as it; only its first label masked."""
  stats = PipelineStats()
  config = dict(max_length=MAX_LENGTH, batching="bucketed_packed", batch_size=4, num_buckets=3, **extra)
  batches = list(make_batches(records, tokenizer, stats=stats, num_epochs=2, **config))
  shapes = batch_shapes(records, tokenizer, **config)
  widths = [t for _, t in shapes]
  assert len(shapes) <= 3 and widths[-1] == MAX_LENGTH and all(b == 4 for b, _ in shapes)
  if extra:
    assert widths == [64, 128, 256]
  expected = sorted((k[0], k[1][1:]) for k in map(as_key, (e for e in examples if e is not None)))
  for epoch in (0, 1):
    segments = []
    for b in (b for b in batches if b["epoch"] == epoch):
      assert b["input_ids"].shape in shapes and set(b) == {"input_ids", "attention_mask", "labels", "segment_ids",
                                                           "positions", "epoch"}
      seg, pos, width = b["segment_ids"], b["positions"], b["input_ids"].shape[1]
      np.testing.assert_array_equal(b["attention_mask"], (seg > 0).astype(np.int32))
      assert (b["input_ids"][seg == 0] == tokenizer.pad_token_id).all() and (b["labels"][seg == 0] == IGNORE_INDEX).all()
      assert (b["labels"][pos == 0] == IGNORE_INDEX).all()
      for row in range(b["input_ids"].shape[0]):
        for s in range(1, seg[row].max() + 1):
          at = np.flatnonzero(seg[row] == s)
          assert (np.diff(at) == 1).all() and pos[row, at].tolist() == list(range(len(at)))
          segments.append((tuple(b["input_ids"][row, at].tolist()), tuple(b["labels"][row, at[1:]].tolist())))
    assert sorted(segments) == expected  # nothing lost or repeated, no batch mixes epochs
  assert stats.padded_tokens == sum(b["input_ids"].size for b in batches)
  assert stats.fill_rows == sum(int((b["attention_mask"].sum(1) == 0).sum()) for b in batches)
  if extra:
    return
  packed = PipelineStats()  # widths chosen by the cost model: within 2 points of packing into one width
  list(make_batches(records, tokenizer, stats=packed, max_length=MAX_LENGTH, batching="packed", batch_size=4,
                    num_epochs=2))
  assert stats.waste_frac <= packed.waste_frac + 0.02


def resume_matches(dataset, stop_after, uninterrupted=None):
  """A run stopped after `stop_after` batches and restored from its JSON state gives the batches an
  uninterrupted run gives (`uninterrupted`: that run's batches, if already read)."""
  uninterrupted = list(dataset) if uninterrupted is None else uninterrupted
  it = iter(dataset)
  for _ in range(stop_after):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # checkpoints store JSON
  if hasattr(it, "close"):
    it.close()
  restored = iter(dataset)
  restored.set_state(state)
  rest = list(restored)
  assert len(rest) == len(uninterrupted) - stop_after
  for a, b in zip(rest, uninterrupted[stop_after:]):
    assert set(a) == set(b)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  return state


@pytest.mark.parametrize("batching,stop_after", [("bucketed", 7), ("bucketed", 31), ("dynamic", 19),
                                                 ("static", 26), ("packed", 9), ("bucketed_packed", 5)])
def test_resume_mid_epoch_gives_identical_batches(records, tokenizer, batching, stop_after):
  ds = make_batches(records, tokenizer, max_length=MAX_LENGTH, batching=batching, batch_size=8, num_epochs=2)
  assert len(list(ds)) > stop_after
  state = resume_matches(ds, stop_after)
  if batching != "packed":  # the bucket batcher's checkpoint format, which saved runs depend on
    assert set(state) == {"anchor", "anchor_seen", "consumed", "emitted", "exhausted"}


@pytest.mark.slow
def test_resume_with_workers(records, tokenizer):
  plain = records[:120]  # no tokenized= and explicit buckets: tokenization runs in the workers
  ds = make_batches(plain, tokenizer, max_length=MAX_LENGTH, bucket_lengths=[64, 128, 192, 256], batch_size=4,
                    num_epochs=2, worker_count=2)
  parallel = list(ds)
  resume_matches(ds, 23, parallel)
  serial = list(make_batches(plain, tokenizer, max_length=MAX_LENGTH, bucket_lengths=[64, 128, 192, 256],
                             batch_size=4, num_epochs=2))
  for epoch in (0, 1):  # workers interleave epoch ends; batches still hold one epoch's examples each
    assert sorted(rows_of([b for b in parallel if b["epoch"] == epoch])) == sorted(
        rows_of([b for b in serial if b["epoch"] == epoch]))


def test_bad_configs(records, tokenizer):
  with pytest.raises(ValueError, match="batching must be one of"):
    make_batches(records, tokenizer, max_length=64, batching="sorted")
  with pytest.raises(ValueError, match="multiple of batch_multiple_of"):
    make_batches(records, tokenizer, max_length=64, batch_size=6, batch_multiple_of=4)
  with pytest.raises(ValueError, match="largest bucket"):
    make_batches(records, tokenizer, max_length=64, bucket_lengths=[16, 32])


def test_the_data_layer_chooses_no_buckets(records, tokenizer, tokens):
  """jaxsft.data batches to the boundaries it is given: without them (or a chooser) the bucketed
  modes are refused before anything is tokenized; the collation's entry points choose them."""
  for batching in ("bucketed", "bucketed_packed"):
    match = f"{batching} batching needs bucket_lengths, or choose_shapes"
    with pytest.raises(ValueError, match=match):
      data.make_batches(records, tokenizer, max_length=MAX_LENGTH, batching=batching)
    with pytest.raises(ValueError, match=match):
      data.batch_shapes(tokenized=tokens, max_length=MAX_LENGTH, batching=batching)
    with pytest.raises(ValueError, match=match):
      data.count_batches(tokens, max_length=MAX_LENGTH, batching=batching)
    assert batch_shapes(tokenized=tokens, max_length=MAX_LENGTH, batching=batching, num_buckets=3)  # chosen here


COUNT_CASES = [("bucketed", {}), ("bucketed", {"bucket_lengths": [64, 128, 192, 256]}), ("dynamic", {}),
               ("static", {}), ("packed", {}),
               ("bucketed", {"tokens_per_batch": 2048, "batch_multiple_of": 2}), ("static", {"tokens_per_batch": 2048}),
               ("packed", {"tokens_per_batch": 2048}), ("bucketed_packed", {}),
               ("bucketed_packed", {"bucket_lengths": [64, 256], "tokens_per_batch": 2048})]


@pytest.mark.parametrize("batching,extra", COUNT_CASES, ids=[f"{b}-{'-'.join(e) or 'batch_size'}" for b, e in COUNT_CASES])
def test_count_batches_equals_one_epoch(records, tokenizer, tokens, batching, extra):
  config = dict(max_length=MAX_LENGTH, batching=batching, batch_size=4, seed=3, **extra)
  emitted = sum(1 for _ in make_batches(records, tokenizer, num_epochs=1, **config))  # tokenizes on its own
  assert count_batches(tokens, num_epochs=5, worker_count=2, **config) == emitted > 0  # epochs, workers: ignored


@pytest.mark.parametrize("batching,extra", [("dynamic", {}), ("bucketed_packed", {"bucket_lengths": [160, 256]})])
def test_epoch_lengths_are_the_epochs_order_and_price_its_batches(records, tokenizer, tokens, batching, extra):
  """`epoch_lengths` is the order the first epoch reads (what the cost model packs and groups when
  `auto` chooses): from it, dynamic padding's and bucketed packing's batches per shape are the
  epoch's, which the record order does not give."""
  from jaxsft.data import epoch_lengths
  from jaxsft.collation.plans import batches_per_shape

  one_by_one = make_batches(records, tokenizer, max_length=MAX_LENGTH, batching="dynamic", batch_size=1,
                            pad_to_multiple_of=1, seed=3, tokenized=tokens)
  in_epoch = epoch_lengths(tokens, seed=3)
  assert [int(b["attention_mask"].sum()) for b in one_by_one] == in_epoch.tolist()
  assert sorted(in_epoch.tolist()) == sorted(tokens.lengths.tolist()) and not np.array_equal(in_epoch, tokens.lengths)
  config = dict(max_length=MAX_LENGTH, batching=batching, batch_size=4, seed=3, **extra)
  emitted = {}
  for b in make_batches(records, tokenizer, tokenized=tokens, **config):
    emitted[b["input_ids"].shape] = emitted.get(b["input_ids"].shape, 0) + 1
  counted = lambda lengths: batches_per_shape(batching, lengths, max_length=MAX_LENGTH, batch_size_for=lambda t: 4,
                                              bucket_lengths=extra.get("bucket_lengths"))[0]
  assert counted(in_epoch) == emitted
  assert counted(tokens.lengths) != emitted  # record order: other batches
  from jaxsft.collation import choice as collation  # what auto and the run's prediction price: this order here, record order where it is free

  assert np.array_equal(collation.priced_lengths(batching, tokens, seed=3), in_epoch)
  assert np.array_equal(collation.priced_lengths("auto", tokens, seed=3), in_epoch)
  assert np.array_equal(collation.priced_lengths("bucketed", tokens, seed=3), tokens.lengths)


@pytest.mark.parametrize("num_batches", [3, 60, 110])
def test_dynamic_batch_shapes_are_those_the_first_batches_of_a_run_emit(records, tokenizer, tokens, num_batches):
  """What a dynamic run warms up: the shapes of the batches it reads, over epochs each in its own
  order (a batch per 4 examples; an epoch's last batch holds its leftovers), not every width."""
  import itertools

  from jaxsft.data import dynamic_batch_shapes

  config = dict(max_length=MAX_LENGTH, batching="dynamic", batch_size=4, seed=3)
  stream = make_batches(records, tokenizer, tokenized=tokens, num_epochs=None, **config)
  emitted = sorted({b["input_ids"].shape for b in itertools.islice(stream, num_batches)})
  assert dynamic_batch_shapes(tokens, num_batches=num_batches, **config) == emitted
  assert (count_batches(tokens, **config) < num_batches) == (num_batches > 3)  # the long cases cross epochs
  assert len(emitted) < len(batch_shapes(tokenized=tokens, **config))  # fewer than every width


def test_dynamic_batch_shapes_past_the_replayed_epochs_are_every_width(tokens, monkeypatch):
  """A run longer than the epochs replayed compiles every width: more than it reads, none mid-run."""
  from jaxsft.data import dynamic_batch_shapes, pipeline

  config = dict(max_length=MAX_LENGTH, batching="dynamic", batch_size=4, seed=3)
  every_width = batch_shapes(tokenized=tokens, **config)
  first_epoch = dynamic_batch_shapes(tokens, num_batches=count_batches(tokens, **config), **config)
  monkeypatch.setattr(pipeline, "REPLAYED_EPOCHS", 1)
  assert dynamic_batch_shapes(tokens, num_batches=count_batches(tokens, **config), **config) == first_epoch
  assert dynamic_batch_shapes(tokens, num_batches=count_batches(tokens, **config) + 1, **config) == every_width


class EncodeCounter:
  """The real tokenizer, but its backend counts the texts it encodes."""

  def __init__(self, tokenizer):
    self.wrapped, self.encoded = tokenizer, 0

  @property
  def backend_tokenizer(self):
    return CountingBackend(self)

  def __getattr__(self, name):
    return getattr(self.wrapped, name)

  def __call__(self, *args, **kwargs):
    return self.wrapped(*args, **kwargs)


class CountingBackend:
  def __init__(self, counter):
    self.counter, self.backend = counter, counter.wrapped.backend_tokenizer

  def encode(self, text, **kwargs):
    self.counter.encoded += 1
    return self.backend.encode(text, **kwargs)

  def encode_batch(self, texts, **kwargs):
    self.counter.encoded += len(texts)
    return self.backend.encode_batch(texts, **kwargs)


def test_one_tokenization_serves_every_call(records, tokenizer, tokens):
  counter = EncodeCounter(tokenizer)
  mine = tokenize_records(counter, records, max_length=MAX_LENGTH)
  assert counter.encoded == len(records)
  for batching in ("bucketed", "dynamic", "static", "packed", "bucketed_packed"):
    config = dict(max_length=MAX_LENGTH, batching=batching, batch_size=8, num_epochs=2)
    batches = list(make_batches(records, counter, tokenized=mine, **config))
    assert batch_shapes(records, counter, tokenized=mine, **config)
    per_epoch = count_batches(mine, **config)
    if batching != "packed":  # packed batches may hold the end of one epoch and the start of the next
      assert 2 * per_epoch == len(batches)
    reference = list(make_batches(records, tokenizer, tokenized=tokens, **config))
    assert len(batches) == len(reference) and all((a[k] == b[k]).all() for a, b in zip(batches, reference) for k in a)
  assert counter.encoded == len(records)  # nothing encoded after tokenize_records


def test_tokenizes_once_or_lazily_per_epoch(records, tokenizer):
  counter = EncodeCounter(tokenizer)
  list(make_batches(records, counter, max_length=MAX_LENGTH, num_epochs=2))  # buckets chosen from the lengths
  assert counter.encoded == len(records)  # tokenized once up front, for the buckets and the batches
  counter.encoded = 0
  list(make_batches(records, counter, max_length=MAX_LENGTH, bucket_lengths=[128, 256], num_epochs=2))
  assert counter.encoded == 2 * len(records)  # without tokenized=, the map encodes every record each epoch


def test_mismatched_tokenized_is_an_error(records, tokenizer, tokens):
  config = dict(max_length=MAX_LENGTH, batching="static")
  for call in (lambda **kw: make_batches(records, tokenizer, tokenized=tokens, **kw),
               lambda **kw: batch_shapes(records, tokenizer, tokenized=tokens, **kw),
               lambda **kw: count_batches(tokens, **kw)):
    with pytest.raises(ValueError, match=f"max_length={MAX_LENGTH}, but max_length=128"):
      call(**{**config, "max_length": 128})
    with pytest.raises(ValueError, match="train_on='all_assistant', but train_on='last'"):
      call(**config, train_on="last")
  with pytest.raises(ValueError, match=f"holds {len(records)} records but {len(records) - 1} records"):
    make_batches(records[:-1], tokenizer, tokenized=tokens, **config)
  with pytest.raises(ValueError, match=f"holds {len(records)} records but {len(records) - 1} records"):
    batch_shapes(records[:-1], tokenizer, tokenized=tokens, **config)
  shorter = tokens.with_max_length(128)  # what a caller does for a smaller max_length
  assert count_batches(shorter, max_length=128, batching="static") == sum(
      1 for _ in make_batches(records, tokenizer, max_length=128, batching="static"))


@pytest.mark.slow
@pytest.mark.parametrize("worker_count", [0, 1])
def test_a_record_the_template_cannot_label_names_its_file_and_line(tokenizer, tmp_path, worker_count):
  """Tokenized in the map (no `tokenized=`), in a worker too: the error names where the record was read."""
  import copy

  tok = copy.deepcopy(tokenizer)
  tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                       "{% if 'zzz' in m['content'] %}(note)\n{% endif %}{% endfor %}")
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "q", "completion": "zzz"}\n')
  batches = make_batches(load_records(path), tok, max_length=64, batching="static", batch_size=2, shuffle=False,
                         worker_count=worker_count)
  with pytest.raises(DataError, match=rf"{path}: line 3: assistant turn 1: .*cannot locate the reply span"):
    list(batches)
