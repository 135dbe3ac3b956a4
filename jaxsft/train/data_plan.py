"""A run's data before step 1: `load_data` reads the records (through their token store; of every
source of a `data.mix`) and holds out the validation split, `plan_data` tokenizes both splits once
and has the collation resolved (`jaxsft.collation.plan`) into a `DataPlan`: bucket shapes, batches
per epoch and the Grain pipelines."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import numpy as np

from jaxsft import collation as collation_lib
from jaxsft.collation.probe import ProbeTarget
from jaxsft import config as config_lib
from jaxsft import data as data_lib
from jaxsft import models
from jaxsft.data import mix as mix_lib

log = logging.getLogger("jaxsft.train")


def load_data(cfg: config_lib.TrainConfig) -> tuple[list[dict], list[dict]]:
  """Training and held-out records. Without a path: jaxsft's generated task set.

  A data file goes through its token store (`data.cache`, the default): tokenized once, later runs
  read it. The training records are then a lazy view of the store and both splits carry their
  tokenization (`.tokenized`), which `plan_data` uses instead of encoding again.
  """
  d = cfg.data  # `config.validate` has refused data.path with data.mix, and an empty mix
  if d.mix is not None:
    return load_mix(cfg)
  if d.path is None:
    from jaxsft.data import synthetic

    records = synthetic.make_dataset(d.synthetic_size, seed=d.seed)
  else:
    records = load_file(d.path, cfg)
  if d.val_path is not None:
    val = load_file(d.val_path, cfg)
    return records, _held_out(val, np.arange(min(len(val), d.max_val_examples)))
  return split_held_out(records, d, max_val=d.max_val_examples, name=d.path)


def split_held_out(records, d: config_lib.DataConfig, *, max_val: int, name: str):
  """(training, held-out) records: `val_fraction` of them (at least one, at most `max_val`) drawn
  with `d.seed`, the rest for training."""
  order = np.random.default_rng(d.seed).permutation(len(records))
  n_val = min(max(1, int(round(len(records) * d.val_fraction))), max_val) if d.val_fraction > 0 else 0
  if n_val >= len(records):
    raise data_lib.DataError(f"{name}: {len(records)} records leave none for training after a {d.val_fraction} validation split")
  if isinstance(records, data_lib.store.StoredRecords):  # views, nothing decoded
    return records.take(order[n_val:]), _held_out(records, order[:n_val])
  return [records[i] for i in order[n_val:]], [records[i] for i in order[:n_val]]


def load_mix(cfg: config_lib.TrainConfig) -> tuple[mix_lib.MixedRecords, list[dict]]:
  """The training records of every `data.mix` source end to end (`mix.MixedRecords`) and the
  held-out records: `data.val_path`'s, else each source's own split (the rule of one source, at
  most ceil(max_val_examples / sources) each), together."""
  d = cfg.data
  for source in d.mix:  # every file is checked before the first is read (or tokenized)
    if not os.path.exists(os.path.expanduser(source.path)):
      raise data_lib.DataError(f"data.mix: {source.path}: no such file or folder")
  max_val = -(-d.max_val_examples // len(d.mix))
  train, held_out = [], []
  for source in d.mix:
    records = load_file(source.path, cfg, fmt=source.format, field_map=source.field_map)
    if d.val_path is not None:
      train.append(records)
      continue
    part, val = split_held_out(records, d, max_val=max_val, name=f"data.mix: {source.path}")
    train.append(part)
    held_out.append(val)
  if d.val_path is not None:
    val = load_file(d.val_path, cfg)
    return mix_lib.mixed_records(train), _held_out(val, np.arange(min(len(val), d.max_val_examples)))
  return mix_lib.mixed_records(train), _joined(held_out)


def _joined(parts: list) -> list[dict]:
  """Held-out record lists as one (with their stored tokenizations joined, where all have one)."""
  records = [r for part in parts for r in part]
  if parts and all(isinstance(p, data_lib.store.RecordList) for p in parts):
    return data_lib.store.RecordList(records, mix_lib.concat_tokenized([p.tokenized for p in parts]))
  return records


def _held_out(records, indices):
  """The held-out records as a plain list (they are written to heldout.json and generated from),
  with their stored tokenization attached when they come from a store."""
  if not isinstance(records, data_lib.store.StoredRecords):
    return [records[i] for i in indices]
  view = records.take(indices)
  return data_lib.store.RecordList(view, view.tokenized)


def load_file(path: str, cfg: config_lib.TrainConfig, *, fmt: str | None = None, field_map: dict | None = None):
  """The records of a data file: a token store's lazy view (`data.cache`), else loaded and checked
  against the chat template, a record it cannot label skipped or named (`data.on_error`). `fmt` and
  `field_map` (a `data.mix` source's) replace `data.format` and `data.field_map`."""
  try:
    return _load_file(path, cfg, fmt=fmt, field_map=field_map)
  except data_lib.DataError as e:
    raise (e.with_skip_hint("data.on_error=skip") if cfg.data.on_error == "raise" else e) from None


def _load_file(path: str, cfg: config_lib.TrainConfig, *, fmt: str | None, field_map: dict | None):
  d = cfg.data
  fmt, field_map = (d.format, d.field_map) if fmt is None else (fmt, field_map)
  tokenizer = models.load_tokenizer(cfg.model.name, chat_template=cfg.model.chat_template)
  if d.cache:
    result = data_lib.open_or_build(path, tokenizer, max_length=d.max_length, train_on=d.train_on, fmt=fmt,
                                    field_map=field_map, on_error=d.on_error, cache_dir=d.cache_dir)
    log.info("token store %s: %s %.1fs: %s", result.store.folder, "built in" if result.built else "found in",
             result.seconds, result.store.summary())
    return result.store.records()
  report = data_lib.SkipReport()
  # Rendered as they load: a record the chat template cannot label is skipped (or named) here.
  records = data_lib.load_records(path, fmt=fmt, field_map=field_map, on_error=d.on_error, report=report,
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
  mix: mix_lib.Mix | None = None  # the sources of `data.mix`, end to end in the training records

  def train_batches(self, tokenizer, *, seed: int, num_epochs: int | None, worker_count: int):
    return data_lib.make_batches(self.train_records, tokenizer, seed=seed, shuffle=True, num_epochs=num_epochs,
                                 worker_count=worker_count, shard_by_process=self.shard_by_process,
                                 stats=self.stats, tokenized=self.train_tokens, mix=self.mix, **self.batching)

  def val_batches(self, tokenizer):
    return data_lib.make_batches(self.val_records, tokenizer, seed=0, shuffle=False, num_epochs=1,
                                 shard_by_process=self.shard_by_process, tokenized=self.val_tokens, **self.batching)


def optimizer_steps(cfg: config_lib.TrainConfig, batches_per_epoch: int) -> int:
  """The run's optimizer steps: `max_steps` (like Hugging Face's, it overrides epochs: the data
  repeats for as long as it takes), else `epochs` of whole accumulations of micro-batches."""
  return cfg.max_steps if cfg.max_steps else max(batches_per_epoch // cfg.optim.grad_accum, 1) * cfg.epochs


def plan_data(cfg: config_lib.TrainConfig, train_records: list[dict], val_records: list[dict], tokenizer,
              batch_multiple_of: int, target: ProbeTarget | None = None, resumed: dict | None = None) -> DataPlan:
  """Both splits tokenized once, the batching resolved by the collation plan (with `target`, the
  trainer's model to probe the step's cost on where the choice needs seconds; `resumed`, the
  collation of the run a checkpoint continues) and every batch shape listed."""
  d = cfg.data
  tokens = dict(max_length=d.max_length, train_on=d.train_on)
  train_tokens = data_lib.store.stored_tokens(train_records, tokenizer, **tokens)
  val_tokens = data_lib.store.stored_tokens(val_records, tokenizer, **tokens)
  if train_tokens is None:
    train_tokens = data_lib.tokenize_records(tokenizer, train_records, **tokens)
  if val_tokens is None:
    val_tokens = data_lib.tokenize_records(tokenizer, val_records, **tokens)
  source = d.path or ("data.mix" if d.mix else "the built-in task set")
  train_tokens.require_trained("the training records", path=source)
  val_tokens.require_trained("the held-out records", path=d.val_path or source, use="score")
  mix, train_lengths = None, None
  if isinstance(train_records, mix_lib.MixedRecords):
    mix = mix_lib.Mix(train_records.sizes, tuple(source.weight for source in d.mix))
    train_lengths = data_lib.epoch_lengths(train_tokens, seed=d.seed, mix=mix)  # what one epoch of the mix reads
  collation = collation_lib.plan(cfg, train_tokens, val_tokens, batch_multiple_of=batch_multiple_of, target=target,
                                 train_lengths=train_lengths, resumed=resumed)
  batching = collation.batching
  if batching["max_length"] != d.max_length:  # chosen from the lengths: the longest example rounded up
    train_tokens = train_tokens.with_max_length(batching["max_length"])
    val_tokens = val_tokens.with_max_length(batching["max_length"])
  shard = jax.process_count() > 1
  batches_per_epoch = data_lib.count_batches(train_tokens, seed=d.seed, shuffle=True, mix=mix, **batching)
  if batching["batching"] == "dynamic" and not shard:
    # Of the widths any batch could have, only those of the batches this run reads: a few, where
    # compiling every width would compile dozens of programs at warm-up for a short run.
    micro_batches = optimizer_steps(cfg, batches_per_epoch) * cfg.optim.grad_accum
    shapes = set(data_lib.dynamic_batch_shapes(train_tokens, num_batches=micro_batches, seed=d.seed, mix=mix,
                                               **batching))
    if val_records:  # one pass, in order
      shapes |= set(data_lib.dynamic_batch_shapes(val_tokens, shuffle=False, **batching))
  else:
    shapes = set(data_lib.batch_shapes(train_records, tokenizer, tokenized=train_tokens, shard_by_process=shard,
                                       **batching))
    if val_records:
      shapes |= set(data_lib.batch_shapes(val_records, tokenizer, tokenized=val_tokens, shard_by_process=shard,
                                          **batching))
  return DataPlan(train_records, val_records, train_tokens, val_tokens, batching, sorted(shapes), batches_per_epoch,
                  data_lib.PipelineStats(), shard, collation, mix)
