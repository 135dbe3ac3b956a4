"""collate, choose_buckets, bucket lookup, padding arithmetic: worked examples, HF parity, properties."""

import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsft.collation.buckets import choose_buckets
from jaxsft.data import (IGNORE_INDEX, BatchPlan, bucket_index, collate, load_records, padding_cost,
                         round_up, target_length, tokenize_example)


def feats(*rows):
  return [{"input_ids": np.asarray(r, dtype=np.int32), "labels": np.asarray(r, dtype=np.int32)} for r in rows]


def test_worked_example_pad_0():
  batch = collate(feats([15, 28, 92, 104], [45, 12, 88, 301, 402, 11, 9], [90, 81, 72, 63, 54]), pad_token_id=0)
  assert batch["input_ids"].shape == (3, 7)
  assert batch["input_ids"].tolist() == [[15, 28, 92, 104, 0, 0, 0], [45, 12, 88, 301, 402, 11, 9],
                                         [90, 81, 72, 63, 54, 0, 0]]
  assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0, 0], [1] * 7, [1, 1, 1, 1, 1, 0, 0]]
  assert batch["labels"].tolist() == [[15, 28, 92, 104, -100, -100, -100], [45, 12, 88, 301, 402, 11, 9],
                                      [90, 81, 72, 63, 54, -100, -100]]
  assert all(v.dtype == np.int32 for v in batch.values())


def test_worked_example_pad_50256():
  batch = collate(feats([101, 25, 48, 92], [205, 18, 99, 401, 55, 12], [310, 88, 14]), pad_token_id=50256)
  assert batch["input_ids"].tolist() == [[101, 25, 48, 92, 50256, 50256], [205, 18, 99, 401, 55, 12],
                                         [310, 88, 14, 50256, 50256, 50256]]
  assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]


def test_buckets_multiple_and_fill_rows():
  f = feats([1, 2, 3], [4, 5, 6, 7, 8])
  assert collate(f, pad_token_id=0, pad_to_multiple_of=8)["input_ids"].shape == (2, 8)
  batch = collate(f, pad_token_id=9, bucket_lengths=[4, 6, 16], batch_size=4)
  assert batch["input_ids"].shape == (4, 6)
  assert (batch["input_ids"][2:] == 9).all() and (batch["attention_mask"][2:] == 0).all()
  assert (batch["labels"][2:] == IGNORE_INDEX).all()
  with pytest.raises(ValueError, match="fits no bucket"):
    collate(f, pad_token_id=0, bucket_lengths=[4])


@pytest.fixture(scope="module")
def chat_records(shared_data):
  return load_records(shared_data / "chat_multiturn_demo.json")[:24]


@pytest.fixture(scope="module")
def chat_features(tokenizer, chat_records):
  return [tokenize_example(tokenizer, r, max_length=4096) for r in chat_records]


def test_pad_equals_eos_keeps_final_end_of_turn_label(tokenizer, chat_records, chat_features):
  assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
  batch = collate(chat_features, pad_token_id=tokenizer.pad_token_id, pad_to_multiple_of=64)
  im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
  assert any(len(r["messages"]) > 2 for r in chat_records)
  for row, (record, f) in enumerate(zip(chat_records, chat_features)):
    n = len(f["input_ids"])
    assert batch["input_ids"][row, n - 2] == im_end and batch["labels"][row, n - 2] == im_end  # final reply's <|im_end|>
    assert batch["labels"][row, n - 1] == IGNORE_INDEX  # the "\n" after it
    # every reply's end-of-turn is trained, though its id is the pad id
    assert (batch["labels"][row] == im_end).sum() == sum(m["role"] == "assistant" for m in record["messages"])


def test_parity_with_transformers_seq2seq_collator(tokenizer, chat_features):
  from transformers import DataCollatorForSeq2Seq

  hf = DataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=8, label_pad_token_id=-100,
                              return_tensors="np")
  for group in (chat_features[:8], chat_features[8:11], chat_features[11:]):
    expected = hf([{"input_ids": f["input_ids"].tolist(), "labels": f["labels"].tolist()} for f in group])
    ours = collate(group, pad_token_id=tokenizer.pad_token_id, pad_to_multiple_of=8)
    for key in ("input_ids", "attention_mask", "labels"):
      np.testing.assert_array_equal(ours[key], np.asarray(expected[key]), err_msg=key)


@st.composite
def features_and_buckets(draw):
  lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
  out = []
  for n in lengths:
    ids = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    labels = [t if draw(st.booleans()) else IGNORE_INDEX for t in ids]
    out.append({"input_ids": np.asarray(ids, np.int32), "labels": np.asarray(labels, np.int32)})
  buckets = sorted(set(draw(st.lists(st.integers(1, 48), max_size=4)) + [draw(st.integers(max(lengths), 64))]))
  extra = draw(st.integers(0, 3))
  return out, buckets, len(out) + extra


@settings(max_examples=60, deadline=None)
@given(features_and_buckets(), st.integers(0, 5))
def test_collate_properties(case, pad):
  features, buckets, batch_size = case
  batch = collate(features, pad_token_id=pad, bucket_lengths=buckets, batch_size=batch_size)
  rows, width = batch["input_ids"].shape
  assert rows == batch_size and width in buckets
  assert width == min(b for b in buckets if b >= max(len(f["input_ids"]) for f in features))
  for i, f in enumerate(features):
    n = len(f["input_ids"])
    np.testing.assert_array_equal(batch["input_ids"][i, :n], f["input_ids"])
    np.testing.assert_array_equal(batch["labels"][i, :n], f["labels"])
    assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
    assert (batch["input_ids"][i, n:] == pad).all() and (batch["labels"][i, n:] == IGNORE_INDEX).all()
  assert (batch["labels"] != IGNORE_INDEX).sum() == sum((f["labels"] != IGNORE_INDEX).sum() for f in features)
  fill = slice(len(features), None)
  assert (batch["attention_mask"][fill] == 0).all() and (batch["labels"][fill] == IGNORE_INDEX).all()


def brute_force(lengths, num_buckets, multiple_of):
  rounded = [round_up(l, multiple_of) for l in lengths]
  values = sorted(set(rounded))
  best = None
  for k in range(num_buckets):
    for inner in itertools.combinations(values[:-1], k):
      cost = padding_cost(rounded, list(inner) + [values[-1]]).padded
      best = cost if best is None else min(best, cost)
  return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=25), st.integers(1, 4), st.sampled_from([1, 4, 8]))
def test_choose_buckets_matches_brute_force(lengths, num_buckets, multiple_of):
  buckets = choose_buckets(lengths, num_buckets, multiple_of=multiple_of)
  assert buckets == sorted(buckets) and len(buckets) <= num_buckets
  assert all(b % multiple_of == 0 for b in buckets)
  assert buckets[-1] == round_up(max(lengths), multiple_of)
  assert padding_cost(lengths, buckets).padded == brute_force(lengths, num_buckets, multiple_of)


def test_choose_buckets_max_length_and_cost_arithmetic():
  lengths = [3, 5, 9, 30, 2000]
  buckets = choose_buckets(lengths, 3, multiple_of=8, max_length=1024)
  assert buckets[-1] == 1024  # the longest example is truncated to max_length
  assert buckets == [8, 32, 1024]
  cost = padding_cost(np.minimum(lengths, 1024), buckets)
  assert cost.real == 3 + 5 + 9 + 30 + 1024 and cost.padded == 8 + 8 + 32 + 32 + 1024
  assert cost.waste == cost.padded - cost.real and cost.num_shapes == 3
  assert choose_buckets([5, 5, 5], 4) == [8]


def test_bucket_index_is_the_one_lookup():
  buckets = [16, 32, 64]
  assert bucket_index(1, buckets) == 0 and bucket_index(16, buckets) == 0 and bucket_index(17, buckets) == 1
  assert bucket_index(np.array([64, 3, 33]), buckets).tolist() == [2, 0, 2]
  assert isinstance(bucket_index(40, buckets), int)
  plan = BatchPlan(tuple(buckets), (4, 2, 1), max_length=64, pad_to_multiple_of=8, pad_token_id=0)
  assert [plan.queue_of(n) for n in (5, 20, 64)] == [0, 1, 2]
  assert target_length(20, bucket_lengths=[64, 16, 32]) == 32  # unsorted boundaries are sorted first
  assert padding_cost([5, 20, 64], buckets).padded == 16 + 32 + 64
  # One error, whichever caller looked the length up.
  for lookup in (lambda: bucket_index(65, buckets), lambda: plan.queue_of(65),
                 lambda: target_length(65, bucket_lengths=buckets), lambda: padding_cost([3, 65], buckets),
                 lambda: collate(feats([1] * 65), pad_token_id=0, bucket_lengths=buckets)):
    with pytest.raises(ValueError, match=r"^an example of 65 tokens fits no bucket \(largest is 64\)$"):
      lookup()


def test_ignore_index_is_defined_once():
  import importlib

  import jaxsft.labels
  import jaxsft.loss

  collate_module = importlib.import_module("jaxsft.data.collate")  # jaxsft.data.collate is the function
  assert IGNORE_INDEX == -100
  assert jaxsft.loss.IGNORE_INDEX is jaxsft.labels.IGNORE_INDEX is collate_module.IGNORE_INDEX is IGNORE_INDEX
  # Neither side pulls the other in, and the shared module pulls in nothing heavy.
  checks = {"jaxsft.loss": "not any(m.startswith('jaxsft.data') for m in sys.modules)",
            "jaxsft.data": "'jaxsft.loss' not in sys.modules",
            "jaxsft.labels": "'jax' not in sys.modules and 'numpy' not in sys.modules"}
  for module, check in checks.items():
    subprocess.run([sys.executable, "-c", f"import sys, {module}; assert {check}, sorted(sys.modules)"], check=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 96), min_size=1, max_size=120), st.sampled_from([[96], [32, 96], [16, 48, 96]]),
       st.integers(1, 5))
def test_width_packer_places_every_item_once_in_rows_that_hold_it(lengths, widths, batch_size):
  """Every item in exactly one row, no row over its width, a mid-epoch batch always B full rows,
  and the cost model's counts are the batches the packer emits."""
  import collections

  from jaxsft.data.rows import WidthPacker, packed_batches_per_shape

  packer = WidthPacker(widths, [batch_size] * len(widths))
  during = [b for i, n in enumerate(lengths) for b in packer.add(n, i)]
  batches = during + packer.flush()
  assert packer.empty() and all(len(rows) == batch_size for _, rows in during)
  placed = []
  for k, rows in batches:
    assert 0 < len(rows) <= batch_size
    for row in rows:
      assert row.items and row.used == sum(lengths[i] for i in row.items) <= widths[k]
      placed += row.items
  assert sorted(placed) == list(range(len(lengths)))
  assert packed_batches_per_shape(lengths, widths, lambda t: batch_size) == dict(
      collections.Counter((batch_size, widths[k]) for k, _ in batches))


def test_width_packer_fills_gaps_emits_the_fullest_rows_and_ends_in_fewer_batches():
  from jaxsft.data.rows import WidthPacker

  def items(rows):
    return [row.items for row in rows]

  # Best fit over every width: a short item fills a wide row's gap instead of opening a narrow row.
  packer = WidthPacker([64, 256], [2, 2])
  assert packer.add(200, "long") == [] and packer.add(50, "short") == []
  assert [items(packer.open_rows(k)) for k in (0, 1)] == [[], [["long", "short"]]]
  # The pool (2 B rows): when a row must open in a full pool, the B fullest leave, the rest go on filling.
  packer = WidthPacker([100], [2])
  assert all(packer.add(n, n) == [] for n in (60, 90, 70, 80))  # no two fit in one row
  ((k, rows),) = packer.add(95, 95)
  assert k == 0 and items(rows) == [[90], [80]]
  assert packer.add(40, 40) == [] and items(packer.open_rows(0)) == [[60, 40], [70], [95]]  # the tightest fit
  # The epoch's end: the wide width's last batch takes the narrow row into a fill row, one batch not two.
  packer = WidthPacker([64, 256], [4, 4])
  assert all(packer.add(n, n) == [] for n in (200, 210, 60))  # 60 fits in neither wide row's gap
  assert [(k, items(rows)) for k, rows in packer.flush()] == [(1, [[210], [200], [60]])]
  with pytest.raises(ValueError, match="wider than the widest row"):
    WidthPacker([64], [1]).add(65, None)
