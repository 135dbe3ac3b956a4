"""A run's data before step 1: `load_data` reads the records (through their token store) and
holds out the validation split, `plan_data` tokenizes both splits once and has the collation
resolved (`jaxsft.collation.plan`) into a `DataPlan`: bucket shapes, batches per epoch and the
Grain pipelines."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from jaxsft import collation as collation_lib
from jaxsft.collation.probe import ProbeTarget
from jaxsft import config as config_lib
from jaxsft import data as data_lib
from jaxsft import models

log = logging.getLogger("jaxsft.train")


def load_data(cfg: config_lib.TrainConfig) -> tuple[list[dict], list[dict]]:
  """Training and held-out records. Without a path: jaxsft's generated task set.

  A data file goes through its token store (`data.cache`, the default): tokenized once, later runs
  read it. The training records are then a lazy view of the store and both splits carry their
  tokenization (`.tokenized`), which `plan_data` uses instead of encoding again.
  """
  d = cfg.data
  if d.path is None:
    from jaxsft.data import synthetic

    records = synthetic.make_dataset(d.synthetic_size, seed=d.seed)
  else:
    records = load_file(d.path, cfg)
  if d.val_path is not None:
    val = load_file(d.val_path, cfg)
    return records, _held_out(val, np.arange(min(len(val), d.max_val_examples)))
  order = np.random.default_rng(d.seed).permutation(len(records))
  n_val = min(max(1, int(round(len(records) * d.val_fraction))), d.max_val_examples) if d.val_fraction > 0 else 0
  if n_val >= len(records):
    raise data_lib.DataError(f"{d.path}: {len(records)} records leave none for training after a {d.val_fraction} validation split")
  if isinstance(records, data_lib.store.StoredRecords):  # views, nothing decoded
    return records.take(order[n_val:]), _held_out(records, order[:n_val])
  return [records[i] for i in order[n_val:]], [records[i] for i in order[:n_val]]


def _held_out(records, indices):
  """The held-out records as a plain list (they are written to heldout.json and generated from),
  with their stored tokenization attached when they come from a store."""
  if not isinstance(records, data_lib.store.StoredRecords):
    return [records[i] for i in indices]
  view = records.take(indices)
  return data_lib.store.RecordList(view, view.tokenized)


def load_file(path: str, cfg: config_lib.TrainConfig):
  """The records of a data file: a token store's lazy view (`data.cache`), else loaded and checked
  against the chat template, a record it cannot label skipped or named (`data.on_error`)."""
  d = cfg.data
  tokenizer = models.load_tokenizer(cfg.model.name)
  if d.cache:
    result = data_lib.open_or_build(path, tokenizer, max_length=d.max_length, train_on=d.train_on, fmt=d.format,
                                    field_map=d.field_map, on_error=d.on_error, cache_dir=d.cache_dir)
    log.info("token store %s: %s %.1fs: %s", result.store.folder, "built in" if result.built else "found in",
             result.seconds, result.store.summary())
    return result.store.records()
  report = data_lib.SkipReport()
  # Rendered as they load: a record the chat template cannot label is skipped (or named) here.
  records = data_lib.load_records(path, fmt=d.format, field_map=d.field_map, on_error=d.on_error, report=report,
                                  check=data_lib.SpanRenderer(tokenizer, train_on=d.train_on))
  if report.skipped:
    log.warning("%s", report.summary())
  return records


@dataclasses.dataclass(frozen=True)
class DataPlan:
  """Both splits, tokenized once (the pipelines reuse it every epoch and every validation); fixed
  once planned, but for `stats`, the pipeline's counters."""

  train_records: list[dict]
  val_records: list[dict]
  train_tokens: data_lib.TokenizedRecords
  val_tokens: data_lib.TokenizedRecords
  batching: dict[str, Any]  # make_batches' batching arguments, buckets resolved
  shapes: list[tuple[int, int]]
  batches_per_epoch: int
  stats: data_lib.PipelineStats
  shard_by_process: bool
  collation: collation_lib.Collation
  """The collation plan the batching comes from: the choice, the lengths it is priced over and what
  the probes compiled."""

  def train_batches(self, tokenizer, *, seed: int, num_epochs: int | None, worker_count: int):
    return data_lib.make_batches(self.train_records, tokenizer, seed=seed, shuffle=True, num_epochs=num_epochs,
                                 worker_count=worker_count, shard_by_process=self.shard_by_process,
                                 stats=self.stats, tokenized=self.train_tokens, **self.batching)

  def val_batches(self, tokenizer):
    return data_lib.make_batches(self.val_records, tokenizer, seed=0, shuffle=False, num_epochs=1,
                                 shard_by_process=self.shard_by_process, tokenized=self.val_tokens, **self.batching)


def plan_data(cfg: config_lib.TrainConfig, train_records: list[dict], val_records: list[dict], tokenizer,
              batch_multiple_of: int, target: ProbeTarget | None = None) -> DataPlan:
  """Both splits tokenized once, the batching resolved by the collation plan (with `target`, the
  trainer's model to probe the step's cost on where the choice needs seconds) and every batch
  shape listed."""
  d = cfg.data
  tokens = dict(max_length=d.max_length, train_on=d.train_on)
  train_tokens = data_lib.store.stored_tokens(train_records, tokenizer, **tokens)
  val_tokens = data_lib.store.stored_tokens(val_records, tokenizer, **tokens)
  if train_tokens is None:
    train_tokens = data_lib.tokenize_records(tokenizer, train_records, **tokens)
  if val_tokens is None:
    val_tokens = data_lib.tokenize_records(tokenizer, val_records, **tokens)
  collation = collation_lib.plan(cfg, train_tokens, val_tokens, batch_multiple_of=batch_multiple_of, target=target)
  batching = collation.batching
  if collation.choice is not None:  # chosen from the lengths: max_length is the longest example rounded up
    train_tokens = train_tokens.with_max_length(batching["max_length"])
    val_tokens = val_tokens.with_max_length(batching["max_length"])
  shard = jax.process_count() > 1
  shapes = set(data_lib.batch_shapes(train_records, tokenizer, tokenized=train_tokens, shard_by_process=shard, **batching))
  if val_records:
    shapes |= set(data_lib.batch_shapes(val_records, tokenizer, tokenized=val_tokens, shard_by_process=shard, **batching))
  batches_per_epoch = data_lib.count_batches(train_tokens, seed=d.seed, shuffle=True, **batching)
  return DataPlan(train_records, val_records, train_tokens, val_tokens, batching, sorted(shapes), batches_per_epoch,
                  data_lib.PipelineStats(), shard, collation)
