"""The token store: exact round trip, keys, damage detection, concurrent builders; streamed
parquet / Arrow / `datasets` folders / JSON arrays."""

import copy
import gzip
import json
import logging
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxsft.data import DataError, load_records, open_or_build, tokenize_example
from jaxsft.data import json_array
from jaxsft.data import store as store_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def same_example(a, b) -> bool:
  if a is None or b is None:
    return a is None and b is None
  return all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in ("input_ids", "labels"))


@pytest.fixture(scope="module")
def chat_file(shared_data):
  return shared_data / "chat_multiturn_demo.json"


def test_round_trip_equals_tokenize_example(tokenizer, chat_file, tmp_path):
  records = load_records(chat_file)
  result = open_or_build(chat_file, tokenizer, max_length=512, cache_dir=tmp_path)
  assert result.built
  store = result.store
  tokenized = store.tokenized()
  assert len(store) == len(records) == len(tokenized)
  for i, record in enumerate(records):
    assert store.record(i) == record
    assert same_example(tokenized.examples[i], tokenize_example(tokenizer, record, max_length=512))
  assert 0 < tokenized.num_dropped == store.manifest["num_dropped"]  # the long tail is cut at 512
  # A shorter max_length from the same store: exact too, lengths without reading an example.
  short = tokenized.with_max_length(96)
  expected = [tokenize_example(tokenizer, r, max_length=96) for r in records]
  assert all(same_example(a, b) for a, b in zip(short.examples, expected))
  assert short.lengths.tolist() == [len(e["input_ids"]) for e in expected if e is not None]
  # A view of some records (a split) reads the same examples.
  picked = [5, 0, 299]
  view = store.records(picked)
  assert [view[k] for k in range(3)] == [records[i] for i in picked]
  assert all(same_example(a, tokenized.examples[i]) for a, i in zip(view.tokenized.examples, picked))
  again = open_or_build(chat_file, tokenizer, max_length=512, cache_dir=tmp_path)
  assert not again.built and again.store.folder == store.folder


def test_every_key_part_invalidates(tokenizer, shared_data, tmp_path):
  data = tmp_path / "d.jsonl"
  rows = [json.loads(l) for l in (shared_data / "gsm8k_test.jsonl").read_text().splitlines()[:20]]
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  base = dict(max_length=128, train_on="all_assistant", fmt="alpaca", on_error="raise",
              field_map={"instruction": "question", "output": "answer"})
  key = lambda path=data, tok=tokenizer, **kw: store_lib.store_key(path, tok, **{**base, **kw})[0]
  other_template = copy.deepcopy(tokenizer)
  other_template.chat_template = tokenizer.chat_template.replace("helpful AI assistant", "terse assistant")
  changed = data.with_name("e.jsonl")
  changed.write_text(data.read_text().replace("?", "?!", 1))
  keys = [key(), key(max_length=256), key(train_on="last"), key(fmt="auto"), key(on_error="skip"),
          key(field_map={"instruction": "question", "output": "answer", "system": "sys"}),
          key(tok=other_template), key(path=changed)]
  assert len(set(keys)) == len(keys)
  assert key() == key(path=pathlib.Path(str(data)))  # the content decides, not the path object
  first = open_or_build(data, tokenizer, cache_dir=tmp_path / "c", **base)
  second = open_or_build(data, other_template, cache_dir=tmp_path / "c", **base)
  assert first.built and second.built and first.store.folder != second.store.folder
  # The template is in the tokens: the system prompt of the other template differs.
  assert not np.array_equal(first.store.tokens[:40], second.store.tokens[:40])


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest"])
def test_damaged_store_is_reported_and_rebuilt(tokenizer, shared_data, tmp_path, caplog, damage):
  data = shared_data / "oasst_top_paths.jsonl"
  built = open_or_build(data, tokenizer, max_length=256, cache_dir=tmp_path).store
  reference = [built.tokenized().examples[i] for i in range(len(built))]
  folder = built.folder
  if damage == "truncate":
    with open(folder / "tokens.bin", "r+b") as f:
      f.truncate(os.path.getsize(folder / "tokens.bin") // 2)
  elif damage == "flip":  # same size, different bytes: only the checksum sees it
    raw = bytearray((folder / "trained.bin").read_bytes())
    raw[len(raw) // 2] ^= 1
    (folder / "trained.bin").write_bytes(bytes(raw))
  else:  # a build killed before its manifest
    (folder / "manifest.json").unlink()
  with pytest.raises(store_lib.StoreError):
    store_lib.TokenStore(folder)
  with caplog.at_level(logging.WARNING, logger="jaxsft.data"):
    again = open_or_build(data, tokenizer, max_length=256, cache_dir=tmp_path)
  damaged_lines = [r for r in caplog.records if "token store damaged" in r.getMessage()]
  assert len(damaged_lines) == 1 and "\n" not in damaged_lines[0].getMessage()
  assert str(folder) in damaged_lines[0].getMessage()
  assert again.built and again.store.folder == folder
  assert all(same_example(a, again.store.tokenized().examples[i]) for i, a in enumerate(reference))
  assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # nothing left aside


_BUILDER = """
import json, sys
from jaxsft.data import open_or_build
from jaxsft.models.hub import load_tokenizer
result = open_or_build(sys.argv[1], load_tokenizer("smollm2-135m-instruct"), max_length=256, cache_dir=sys.argv[2])
print(json.dumps({"folder": str(result.store.folder), "built": result.built, "kept": result.store.manifest["num_kept"]}))
"""


@pytest.mark.slow
def test_two_processes_build_the_same_store(shared_data, tmp_path):
  data = shared_data / "alpaca_en_demo.json"
  env = dict(os.environ, HF_HUB_OFFLINE="1")
  procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(data), str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  assert results[0]["folder"] == results[1]["folder"] and results[0]["kept"] == results[1]["kept"] == 999
  assert [p.name for p in tmp_path.iterdir()] == [pathlib.Path(results[0]["folder"]).name]  # no temp folder left
  store_lib.TokenStore(results[0]["folder"])  # whole: manifest, sizes and checksums agree


# ---------------------------------------------------------------------------------------------
# Streamed sources.

ROWS = [{"instruction": f"Question {i}", "input": "" if i % 2 else f"context {i}", "output": f"Answer {i}"}
        for i in range(10)]


def write_datasets_folder(folder: pathlib.Path, rows: list[dict], shards: int = 2) -> None:
  """The layout `datasets.Dataset.save_to_disk` writes: data-XXXXX-of-YYYYY.arrow shards in the
  Arrow IPC *stream* format, listed in state.json's `_data_files`, beside dataset_info.json."""
  pa = pytest.importorskip("pyarrow")
  folder.mkdir(parents=True)
  names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
  per = -(-len(rows) // shards)
  for i, name in enumerate(names):
    table = pa.Table.from_pylist(rows[i * per:(i + 1) * per])
    with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
      writer.write_table(table, max_chunksize=2)
  (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                 "_fingerprint": "0", "_format_type": None, "_split": None}))
  (folder / "dataset_info.json").write_text("{}")


def test_parquet_and_datasets_folders(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq

  expected = load_records(_jsonl(tmp_path / "rows.jsonl", ROWS))
  pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet", row_group_size=3)
  shards = tmp_path / "shards"
  shards.mkdir()
  for i in range(3):
    pq.write_table(pa.Table.from_pylist(ROWS[i * 4:(i + 1) * 4]), shards / f"part-{i:03d}.parquet")
  write_datasets_folder(tmp_path / "saved", ROWS)
  dict_folder = tmp_path / "saved_dict"
  write_datasets_folder(dict_folder / "train", ROWS)
  (dict_folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
  ipc_file = tmp_path / "rows.arrow"  # the IPC *file* format
  with pa.OSFile(str(ipc_file), "wb") as sink, pa.ipc.new_file(sink, pa.Table.from_pylist(ROWS).schema) as w:
    w.write_table(pa.Table.from_pylist(ROWS))
  for source in (tmp_path / "rows.parquet", shards, tmp_path / "saved", dict_folder, ipc_file):
    assert load_records(source) == expected, source


def test_bad_rows_are_named(tmp_path, tokenizer):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq

  rows = [dict(r) for r in ROWS]
  rows[7]["output"] = "  "
  shards = tmp_path / "shards"
  shards.mkdir()
  pq.write_table(pa.Table.from_pylist(rows[:5]), shards / "a.parquet")
  pq.write_table(pa.Table.from_pylist(rows[5:]), shards / "b.parquet")
  with pytest.raises(DataError) as info:
    load_records(shards)
  assert str(shards) in str(info.value) and "b.parquet row 2" in str(info.value)
  assert "'output'" in str(info.value) and "empty assistant reply" in str(info.value)
  write_datasets_folder(tmp_path / "saved", rows)
  with pytest.raises(DataError, match=r"data-00001-of-00002.arrow row 2: field 'output'"):
    load_records(tmp_path / "saved")
  # Skipped rows are counted in the store's manifest.
  result = open_or_build(tmp_path / "saved", tokenizer, max_length=64, on_error="skip", cache_dir=tmp_path / "c")
  assert result.store.manifest["skipped"] == 1 and len(result.store) == 9
  with pytest.raises(DataError, match="pass the split's folder"):
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "dataset_dict.json").write_text(json.dumps({"splits": ["a", "b"]}))
    load_records(tmp_path / "two")


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_json_array_is_streamed_exactly(shared_data, tmp_path, monkeypatch):
  monkeypatch.setattr(json_array, "CHUNK", 97)  # elements straddle every buffer boundary
  for name in ("alpaca_en_demo.json", "chat_multiturn_demo.json"):
    path = shared_data / name
    raw = json.loads(path.read_text())
    with open(path) as f:
      assert [r for _, r in json_array.read_json_array(f)] == raw
  gz = tmp_path / "chat.json.gz"
  with gzip.open(gz, "wt") as f:
    f.write((shared_data / "chat_multiturn_demo.json").read_text())
  assert load_records(gz) == load_records(shared_data / "chat_multiturn_demo.json")
  bad = tmp_path / "bad.json"
  bad.write_text("[" + ",\n".join(json.dumps(r) for r in ROWS) + ',\n{"instruction": "x" "output": "y"}]')
  with pytest.raises(DataError, match=r"bad.json: line 11: invalid JSON: Expecting ',' delimiter \(column 21\)"):
    load_records(bad)


def test_build_memory_is_bounded(tokenizer, tmp_path):
  """Records are streamed into the store: the records iterator is consumed as the build goes,
  never materialized (a generator the store builder reads once)."""
  consumed = []

  def records():
    for i in range(3000):
      consumed.append(i)
      yield {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}

  from jaxsft.data.tokenize import encode_batches

  stream = encode_batches(tokenizer, records(), max_length=64, batch_size=256)
  next(stream)
  assert len(consumed) <= 3 * 256  # the first batch comes out after at most three were read


@pytest.mark.parametrize("batching", ["bucketed", "dynamic", "packed"])
def test_pipeline_over_the_store_matches_the_in_memory_one(tokenizer, chat_file, tmp_path, batching):
  """Batches, shapes and counts from a store are those of the in-memory tokenization, and the
  store's counts read no example (lengths only)."""
  from jaxsft.collation.batches import batch_shapes, count_batches, make_batches
  from jaxsft.data import tokenize_records

  records = load_records(chat_file)
  store = open_or_build(chat_file, tokenizer, max_length=256, cache_dir=tmp_path).store
  stored, memory = store.tokenized(), tokenize_records(tokenizer, records, max_length=256)
  config = dict(max_length=256, batching=batching, batch_size=4, num_epochs=2, num_buckets=3, seed=3)
  a = list(make_batches(store.records(), tokenizer, tokenized=stored, **config))
  b = list(make_batches(records, tokenizer, tokenized=memory, **config))
  assert len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
  assert batch_shapes(tokenized=stored, **config) == batch_shapes(tokenized=memory, **config)
  reads = []
  original = store_lib.TokenStore.example
  store_lib.TokenStore.example = lambda self, *args: reads.append(args) or original(self, *args)
  try:
    assert count_batches(stored, **config) == count_batches(memory, **config)
  finally:
    store_lib.TokenStore.example = original
  assert reads == []
  if batching == "dynamic":  # the widths of the data, not every multiple of 8 up to 256
    widths = {t for _, t in batch_shapes(tokenized=stored, **config)}
    assert widths == {min(-(-int(n) // 8) * 8, 256) for n in stored.lengths} and {t for x in a for t in [x["input_ids"].shape[1]]} <= widths


@pytest.mark.parametrize("batching", ["bucketed", "packed"])
def test_resume_over_the_store_past_an_epoch(tokenizer, chat_file, tmp_path, batching):
  """The trainer's max_steps pipeline (num_epochs=None) over a store: a state saved in the second
  epoch restores to the same following batches."""
  from jaxsft.collation.batches import make_batches

  store = open_or_build(chat_file, tokenizer, max_length=256, cache_dir=tmp_path).store
  ds = make_batches(store.records(), tokenizer, tokenized=store.tokenized(), max_length=256, batching=batching,
                    batch_size=8, num_epochs=None, seed=1)
  it = iter(ds)
  first = [next(it) for _ in range(60)]  # one epoch is about 38 batches
  assert first[-1]["epoch"] == 1
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(10)]
  restored = iter(ds)
  restored.set_state(state)
  for a, b in zip([next(restored) for _ in range(10)], expected):
    assert all(np.array_equal(a[k], b[k]) for k in a)
