"""Records to batches with Grain: shuffle per epoch, tokenize, then bucket/dynamic/static/packed.

    MapDataset.range(N) -> shuffle(seed) -> repeat(num_epochs) -> map_with_index(tokenize)
      -> to_iter_dataset -> [mp_prefetch(worker_count)] -> BucketBatchIterDataset | FirstFit packing

`MapDataset.repeat` reseeds the shuffle every epoch, so epoch e is a permutation drawn from
(seed, e). With a `mix` (`mix.Mix`, `data.mix`), `MapDataset.range(N) -> shuffle` is
`Mix.indices`: the sources' records, each source shuffled on its own, interleaved by weight with
`MapDataset.mix`; an epoch is the mix's, and each element carries its `source`. Every element carries its epoch; examples dropped by truncation (no trained token
left) travel on as markers, so the batcher can count them and tell when an epoch is complete.
Bucket, dynamic and static batching are `bucketing.BucketBatchIterDataset` (no batch mixes
epochs, leftovers are padded, never dropped); packed mode is `packing.packed_batches`.

Tokenization: a `TokenizedRecords` (`tokenize_records`) passed as `tokenized=` is the cache the
caller owns: `make_batches`, `batch_shapes` and `count_batches` then encode nothing. One from a
token store (`store.TokenStore.tokenized`, `records` then `TokenStore.records`) makes the map a
random-access read of the memory-mapped store: each example is sliced from it when the shuffled
index reaches it, and the lengths that choose buckets, widths and batch counts come from the
store's length arrays without reading any example. Without it
the map tokenizes each record as it is read, every epoch (in the workers when `worker_count > 0`),
except bucketed batching without `bucket_lengths`, which tokenizes every record once up front to
choose the buckets and batches from that.

Bucket boundaries and packing widths: `bucket_lengths`, or, without them, `choose_shapes` chooses
them from the token lengths. Which shapes a run batches to is `jaxsft.collation`'s decision, above
this layer: its `make_batches`, `batch_shapes` and `count_batches` are these with its chooser
(the bucket DP, the packing widths the cost model prices cheapest).

Batch sizes: `batch_size` rows per batch, or with `tokens_per_batch` B_k = tokens_per_batch // T_k
rounded down to a multiple of `batch_multiple_of` (at least one multiple). Every batch also has
`"epoch"` (0-d int32). `count_batches` gives the number of batches of one epoch from the lengths.

Multi-host (`shard_by_process=True`): every JAX process runs the same pipeline over all records
and keeps rows [i*B/P, (i+1)*B/P) of each global batch (P processes from grain's
`ShardByJaxProcess`), so all processes step through identical shapes in lockstep. `batch_size`,
`tokens_per_batch`, `batch_shapes` and `count_batches` are global.

With workers, each worker tokenizes its slice of the stream and sends chunks of 32 examples
(grain's `batch` with `batch_fn=list` before `mp_prefetch`; the bucket batcher reads the chunks,
packed mode unchunks them with `FlatMapIterDataset`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import grain
import numpy as np

from jaxsft.config_checks import BATCHING  # the config's list of choices (data.batching)
from jaxsft.data.bucketing import BatchPlan, BucketBatchIterDataset
from jaxsft.data.collate import batch_widths, bucket_index
from jaxsft.data.examples import TokenizedRecords
from jaxsft.data.mix import Mix
from jaxsft.data.packing import packed_batches
from jaxsft.data.pipeline_stats import PipelineStats
from jaxsft.data.rows import packed_batches_per_shape
from jaxsft.data.tokenize import encode_with_length, record_error, tokenize_records


# ---------------------------------------------------------------------------------------------
# The tokenized stream.


class _TokenizeStep:
  """map_with_index(index, record_index) -> example dict with epoch bookkeeping.

  Looks the example up in `tokenized` when given, else tokenizes the record (in the worker
  processes when `worker_count > 0`). With a `mix`, the record index is a global one, an epoch is
  the mix's, and each element names its `source`.
  """

  def __init__(self, records, tokenizer, *, max_length: int, train_on: str, tokenized: TokenizedRecords | None,
               mix: Mix | None = None):
    self.records, self.tokenizer, self.max_length, self.train_on = records, tokenizer, max_length, train_on
    self.tokenized, self.mix = tokenized, mix
    self.num_records = len(tokenized) if tokenized is not None else len(records)
    self.epoch_size = mix.epoch_size if mix is not None else self.num_records

  def __call__(self, index: int, record_index: int) -> dict:
    record_index = int(record_index)
    if self.tokenized is not None:
      example, full_length = self.tokenized.examples[record_index], int(self.tokenized.full_lengths[record_index])
    else:
      record = self.records[record_index]
      try:
        example, full_length = encode_with_length(self.tokenizer, record, max_length=self.max_length,
                                                  train_on=self.train_on)
      except ValueError as e:  # a DataError naming the record's file and line where it knows them
        raise record_error(e, record, record_index) from None
    out = dict(example) if example is not None else {}
    out.update(epoch=index // self.epoch_size, full_length=full_length)
    if self.mix is not None:
      out["source"] = self.mix.source_of(record_index)
    return out


_IPC_CHUNK = 32


class _Unchunk(grain.experimental.FlatMapTransform):
  max_fan_out = _IPC_CHUNK

  def flat_map(self, chunk):
    return chunk


def _example_stream(step: _TokenizeStep, *, seed: int, shuffle: bool, num_epochs: int | None, worker_count: int,
                    unchunk: bool) -> grain.IterDataset:
  """The shuffled, repeated, tokenized elements; chunked across processes when `worker_count > 0`
  (unchunked again when `unchunk`)."""
  if step.mix is not None:  # the sources' global record indices, interleaved by weight
    ds = step.mix.indices(seed, shuffle)
  else:
    ds = grain.MapDataset.range(step.num_records)
    if shuffle:
      ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs).map_with_index(step)
  # A pre-tokenized example is a list lookup: reader threads would only add overhead.
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0 if step.tokenized is not None else 2,
                                            prefetch_buffer_size=64))
  if worker_count <= 0 or step.tokenized is not None:  # workers would only pickle lookups across processes
    return it
  from absl import flags  # grain's workers read absl flags; unparsed flags raise there

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  # Workers send chunks of examples: per-element inter-process traffic costs more than tokenizing,
  # and small arrays are cheaper pickled than in one shared-memory segment each.
  it = it.batch(_IPC_CHUNK, batch_fn=list)
  it = grain.experimental.WithOptionsIterDataset(it, grain.experimental.DatasetOptions(min_shm_size=1 << 20))
  it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
  return grain.experimental.FlatMapIterDataset(it, _Unchunk()) if unchunk else it


# ---------------------------------------------------------------------------------------------
# Batching arguments to a BatchPlan.

ShapeChooser = Callable[..., Sequence[int]]
"""`choose_shapes(lengths, *, batching, num_buckets, multiple_of, max_length, batch_size_for)`: at most
`num_buckets` bucket boundaries ("bucketed") or packing widths ("bucketed_packed") for the kept
examples' token `lengths` (already cut to `max_length`), each a multiple of `multiple_of` or
`max_length`, the largest the longest example's; `batch_size_for(T)` is the rows of a batch of width
T. The caller's (`jaxsft.collation.batches.choose_shapes`): this layer chooses no shapes itself."""


@dataclasses.dataclass(frozen=True)
class _BatchingOptions:
  """The batching arguments `make_batches`, `batch_shapes` and `count_batches` share, checked on
  construction (before anything is tokenized)."""

  max_length: int
  batching: str
  bucket_lengths: Sequence[int] | None
  num_buckets: int
  batch_size: int
  tokens_per_batch: int | None
  pad_to_multiple_of: int
  batch_multiple_of: int
  shard_by_process: bool
  choose_shapes: ShapeChooser | None = None

  def __post_init__(self):
    if self.batching not in BATCHING:
      raise ValueError(f"batching must be one of {BATCHING}, got {self.batching!r}")
    if self.max_length < 1 or self.batch_size < 1:
      raise ValueError(f"max_length and batch_size must be positive, got {self.max_length}, {self.batch_size}")
    if self.tokens_per_batch is None and self.batch_size % self.multiple:
      raise ValueError(f"batch_size {self.batch_size} must be a multiple of batch_multiple_of x processes = "
                       f"{self.multiple}")
    if self.tokens_per_batch is not None and self.batching == "dynamic":
      raise ValueError("tokens_per_batch needs a fixed T per batch: use static, bucketed or packed batching")
    if self.bucketed and self.bucket_lengths is not None and max(self.bucket_lengths) < self.max_length:
      raise ValueError(f"the largest bucket ({max(self.bucket_lengths)}) must be >= max_length ({self.max_length}): "
                       "examples are truncated to max_length, not to the largest bucket")
    if self.chooses_buckets and self.choose_shapes is None:
      raise ValueError(f"{self.batching} batching needs bucket_lengths, or choose_shapes to choose them from the token "
                       "lengths (jaxsft.collation's make_batches, batch_shapes and count_batches pass theirs)")

  @functools.cached_property
  def shard(self) -> tuple[int, int]:
    """(this process's index, process count) of the rows of every global batch."""
    if not self.shard_by_process:
      return 0, 1
    shard = grain.sharding.ShardByJaxProcess()
    return shard.shard_index, shard.shard_count

  @property
  def multiple(self) -> int:
    """Every batch size is a multiple of it, so each data-parallel shard and process gets whole rows."""
    return math.lcm(max(self.batch_multiple_of, 1), self.shard[1])

  @property
  def bucketed(self) -> bool:
    return self.batching in ("bucketed", "bucketed_packed")

  @property
  def chooses_buckets(self) -> bool:
    """Bucketed (or bucketed packing) without `bucket_lengths`: the boundaries come from the token lengths."""
    return self.bucketed and self.bucket_lengths is None

  def batch_size_for(self, width: int) -> int:
    if self.tokens_per_batch is None:
      return self.batch_size
    return max((self.tokens_per_batch // width) // self.multiple * self.multiple, self.multiple)

  def plan(self, *, lengths: Sequence[int] | None, epoch_size: int, pad_token_id: int) -> BatchPlan:
    """The BatchPlan; `lengths` (kept examples' token counts) is needed only when `chooses_buckets`."""
    common = dict(max_length=self.max_length, pad_to_multiple_of=self.pad_to_multiple_of, pad_token_id=pad_token_id,
                  epoch_size=epoch_size, shard_index=self.shard[0], shard_count=self.shard[1])
    if self.batching == "dynamic":
      return BatchPlan(None, (self.batch_size_for(self.max_length),), **common)
    if self.batching in ("static", "packed"):
      return BatchPlan((self.max_length,), (self.batch_size_for(self.max_length),), **common)
    if self.bucket_lengths is not None:
      buckets = sorted({int(b) for b in self.bucket_lengths})  # a repeated width is one bucket
    else:
      buckets = list(self.choose_shapes(np.minimum(lengths, self.max_length), batching=self.batching,
                                        num_buckets=self.num_buckets, multiple_of=self.pad_to_multiple_of,
                                        max_length=self.max_length, batch_size_for=self.batch_size_for))
    return BatchPlan(tuple(buckets), tuple(self.batch_size_for(b) for b in buckets), packed=self.batching == "bucketed_packed",
                     **common)


def _pad_token_id(tokenizer) -> int:
  """The tokenizer's pad id, else its eos id (pad rows are masked, so any id works), else 0."""
  if tokenizer is None:
    return 0
  if tokenizer.pad_token_id is not None:
    return tokenizer.pad_token_id
  return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


# ---------------------------------------------------------------------------------------------
# Entry points.


def make_batches(records: Sequence[dict], tokenizer, *, max_length: int, batching: str = "bucketed",
                 bucket_lengths: Sequence[int] | None = None, num_buckets: int = 8, batch_size: int = 8,
                 tokens_per_batch: int | None = None, pad_to_multiple_of: int = 8, batch_multiple_of: int = 1,
                 seed: int = 0, shuffle: bool = True, num_epochs: int | None = 1,
                 train_on: str = "all_assistant", worker_count: int = 0, shard_by_process: bool = False,
                 stats: PipelineStats | None = None, tokenized: TokenizedRecords | None = None,
                 mix: Mix | None = None, choose_shapes: ShapeChooser | None = None) -> grain.IterDataset:
  """A Grain `IterDataset` of training batches from chat records (see the module docstring).

  Each batch is a dict of int32 numpy arrays `input_ids`, `attention_mask`, `labels` of shape
  (B, T) (packed mode adds `segment_ids` and `positions`) and a 0-d int32 `epoch`. The shapes are
  those of `batch_shapes(...)` with the same arguments.

  Args:
    records: `{"messages": [...]}` records (`load_records`).
    tokenizer: a fast Hugging Face tokenizer with `pad_token_id` (else eos is used for padding).
    max_length: examples keep their first max_length tokens; ones left with no trained token are
      dropped and counted in `stats.dropped`.
    batching: "static" (T = max_length), "dynamic" (T = batch maximum rounded up to
      pad_to_multiple_of), "bucketed" (T = the example's bucket), "packed" (first-fit packing into
      rows of max_length with segment ids and per-segment positions) or "bucketed_packed" (packed
      rows of a few widths, `rows.WidthPacker`).
    bucket_lengths: bucket boundaries (bucketed packing: the row widths); None has `choose_shapes` choose
      `num_buckets` of them over the token lengths (of `tokenized`, else of every record tokenized
      once here).
    batch_size / tokens_per_batch: rows per batch, or a token budget B_k = tokens_per_batch // T_k.
    batch_multiple_of: every batch size is a multiple of it (the data-parallel degree).
    seed, shuffle, num_epochs: epoch e is shuffled with a seed derived from (seed, e); None repeats
      forever.
    train_on: "all_assistant" or "last".
    worker_count: > 0 tokenizes in that many processes (`mp_prefetch`); ignored with `tokenized`
      (nothing is left to tokenize).
    shard_by_process: each JAX process keeps its rows of every global batch.
    stats: a `PipelineStats` updated in place; also reachable as the returned dataset's `.stats`.
    tokenized: `tokenize_records(tokenizer, records, max_length=..., train_on=...)`, so nothing is
      encoded again; a different record count, max_length or train_on is a ValueError.
    mix: several sources laid end to end in `records` (`mix.Mix`): each epoch draws them by weight
      (`Mix.indices`) instead of shuffling the records as one; every example carries its `source`
      and `stats` counts each source's examples and trained tokens.
    choose_shapes: chooses the buckets or widths where `bucket_lengths` is None (`ShapeChooser`;
      `jaxsft.collation.make_batches` passes the collation's); without either, bucketed modes are a
      ValueError.
  """
  if not len(records):
    raise ValueError("make_batches needs at least one record")
  if mix is not None and mix.num_records != len(records):
    raise ValueError(f"the mix's sources hold {mix.num_records} records but {len(records)} records were passed")
  options = _BatchingOptions(max_length, batching, bucket_lengths, num_buckets, batch_size, tokens_per_batch,
                             pad_to_multiple_of, batch_multiple_of, shard_by_process, choose_shapes)
  if tokenized is not None:
    tokenized.check_matches(num_records=len(records), max_length=max_length, train_on=train_on)
  elif options.chooses_buckets:  # the bucket choice needs every length: tokenize once, batch from that too
    tokenized = tokenize_records(tokenizer, records, max_length=max_length, train_on=train_on)
  stats = stats if stats is not None else PipelineStats()
  step = _TokenizeStep(records, tokenizer, max_length=max_length, train_on=train_on, tokenized=tokenized, mix=mix)
  plan = options.plan(lengths=tokenized.lengths if options.chooses_buckets else None, epoch_size=step.epoch_size,
                      pad_token_id=_pad_token_id(tokenizer))
  stream = _example_stream(step, seed=seed, shuffle=shuffle, num_epochs=num_epochs, worker_count=worker_count,
                           unchunk=batching == "packed")  # the bucket batcher reads chunks itself
  if batching == "packed":
    out = packed_batches(stream, plan, seed=seed, stats=stats, sources=mix is not None)
  else:
    out = BucketBatchIterDataset(stream, plan, stats)
  out.stats, out.plan = stats, plan
  return out


def batch_shapes(records: Sequence[dict] | None = None, tokenizer=None, *, lengths: Sequence[int] | None = None,
                 max_length: int, batching: str = "bucketed", bucket_lengths: Sequence[int] | None = None,
                 num_buckets: int = 8, batch_size: int = 8, tokens_per_batch: int | None = None,
                 pad_to_multiple_of: int = 8, batch_multiple_of: int = 1, train_on: str = "all_assistant",
                 shard_by_process: bool = False, tokenized: TokenizedRecords | None = None,
                 choose_shapes: ShapeChooser | None = None, **_ignored) -> list[tuple[int, int]]:
  """Every global (B, T) `make_batches` with the same arguments can emit, sorted.

  Accepts (and ignores) make_batches' other arguments (seed, shuffle, num_epochs, worker_count,
  stats), so a trainer can pass one config dict to both. Bucketed without `bucket_lengths` needs
  `choose_shapes` and the token lengths: `lengths`, `tokenized`, or `records` + `tokenizer`
  (tokenized here, and again by `make_batches` unless you pass both one `tokenized`). Dynamic: a batch is as wide as its
  longest example rounded up, so with the lengths (`lengths` or `tokenized`) the widths are
  {min(round_up(L, pad_to_multiple_of), max_length)} over the examples' lengths L; without them,
  every multiple of pad_to_multiple_of up to max_length (and max_length).
  """
  options = _BatchingOptions(max_length, batching, bucket_lengths, num_buckets, batch_size, tokens_per_batch,
                             pad_to_multiple_of, batch_multiple_of, shard_by_process, choose_shapes)
  if tokenized is not None:
    tokenized.check_matches(num_records=None if records is None else len(records), max_length=max_length,
                            train_on=train_on)
  if options.chooses_buckets and lengths is None:
    if tokenized is None and (records is None or tokenizer is None):
      raise ValueError("bucketed batching without bucket_lengths needs lengths, tokenized, or records + tokenizer")
    if tokenized is None:
      tokenized = tokenize_records(tokenizer, records, max_length=max_length, train_on=train_on)
    lengths = tokenized.lengths
  plan = options.plan(lengths=lengths, epoch_size=0, pad_token_id=0)
  if plan.bucket_lengths is None:
    m = max(pad_to_multiple_of, 1)
    if lengths is None and tokenized is not None:
      lengths = tokenized.lengths
    if lengths is not None:
      widths = sorted({min(w, max_length) for w in (-(-np.asarray(lengths, np.int64) // m) * m).tolist()})
    else:
      widths = sorted({min(w, max_length) for w in range(m, max_length + m, m)})
    return [(plan.batch_sizes[0], w) for w in widths]
  return sorted(zip(plan.batch_sizes, plan.bucket_lengths))


def epoch_lengths(tokenized: TokenizedRecords, *, seed: int = 0, shuffle: bool = True,
                  mix: Mix | None = None, epoch: int = 0) -> np.ndarray:
  """The kept examples' token counts in the order epoch `epoch` (the first: 0) of `make_batches`
  reads them (`seed`, `shuffle`, `mix` as there): what packing sees, unlike record order (a
  store's come from its length arrays: nothing is read)."""
  n = len(tokenized)
  if mix is not None:  # the mix's epoch: its positions, some sources only partly read
    order = mix.epoch_order(seed, shuffle, epoch)
  elif shuffle:  # make_batches' shuffle, reshuffled each epoch; indexed, which is ~25x faster than iterating it
    shuffled = grain.MapDataset.range(n).shuffle(seed=seed)
    order = np.fromiter((shuffled[i] for i in range(epoch * n, (epoch + 1) * n)), dtype=np.int64, count=n)
  else:
    order = np.arange(n)
  in_order = tokenized.examples.record_lengths()[order]
  return in_order[in_order > 0]


REPLAYED_EPOCHS, REPLAYED_EXAMPLES = 16, 500_000
"""How far `dynamic_batch_shapes` replays a run's epoch orders (a few seconds at most)."""


def dynamic_batch_shapes(tokenized: TokenizedRecords, *, max_length: int, num_batches: int | None = None,
                         batch_size: int = 8, pad_to_multiple_of: int = 8, seed: int = 0, shuffle: bool = True,
                         mix: Mix | None = None, train_on: str = "all_assistant", **_ignored) -> list[tuple[int, int]]:
  """The (B, T) of the first `num_batches` batches (None: one epoch's) dynamic batching emits,
  sorted: each epoch's examples in its order (`epoch_lengths`), B at a time, as wide as
  `collate.batch_widths` makes them. What a run of that many batches compiles, where
  `batch_shapes` lists every width any batch could have.

  Replaying an epoch's order costs ~10 µs an example: past `REPLAYED_EPOCHS` epochs or
  `REPLAYED_EXAMPLES` examples, the batches left may have any width (`batch_shapes`' list, a
  superset: a run compiles more, never again mid-run)."""
  widths: set[int] = set()
  epoch, left = 0, num_batches
  while left is None or left > 0:
    if epoch >= REPLAYED_EPOCHS or (epoch + 1) * len(tokenized) > REPLAYED_EXAMPLES:
      widths.update(t for _, t in batch_shapes(tokenized=tokenized, max_length=max_length, batching="dynamic",
                                                batch_size=batch_size, pad_to_multiple_of=pad_to_multiple_of,
                                                train_on=train_on))
      break
    lengths = epoch_lengths(tokenized, seed=seed, shuffle=shuffle, mix=mix, epoch=epoch)
    epoch_widths = batch_widths(np.minimum(lengths, max_length), batch_size, pad_to_multiple_of, max_length)
    widths.update(epoch_widths[:left].tolist())
    if left is None or len(lengths) == 0:
      break
    epoch, left = epoch + 1, left - len(epoch_widths)
  return [(batch_size, int(w)) for w in sorted(widths)]


def count_batches(tokenized: TokenizedRecords, *, max_length: int, batching: str = "bucketed",
                  bucket_lengths: Sequence[int] | None = None, num_buckets: int = 8, batch_size: int = 8,
                  tokens_per_batch: int | None = None, pad_to_multiple_of: int = 8, batch_multiple_of: int = 1,
                  seed: int = 0, shuffle: bool = True, train_on: str = "all_assistant",
                  shard_by_process: bool = False, mix: Mix | None = None, choose_shapes: ShapeChooser | None = None,
                  **_ignored) -> int:
  """The number of global batches one epoch of `make_batches` with the same arguments yields.

  Accepts (and ignores) make_batches' other arguments, like `batch_shapes`. Bucketed, static and
  dynamic are counted from the lengths: every epoch flushes its leftovers per bucket, so one epoch
  is the sum over buckets of ceil(n_k / B_k) (dropped examples excluded). Packed mode runs grain's
  packer over the pre-tokenized examples (in the epoch's order, which `seed`/`shuffle` decide);
  over a token store, over stand-ins of the stored lengths (no example is read). With a `mix`, the
  mix's first epoch (`mix.Mix`): later epochs read other records of the sources that were not
  exhausted, so their count may differ by a few batches (as a packed epoch's may).
  """
  options = _BatchingOptions(max_length, batching, bucket_lengths, num_buckets, batch_size, tokens_per_batch,
                             pad_to_multiple_of, batch_multiple_of, shard_by_process, choose_shapes)
  tokenized.check_matches(num_records=None, max_length=max_length, train_on=train_on)
  lengths = tokenized.lengths
  plan = options.plan(lengths=lengths, epoch_size=mix.epoch_size if mix else len(tokenized), pad_token_id=0)
  if batching == "packed":
    tokenized = tokenized.length_view()  # a store's: length stand-ins, no example is read
    step = _TokenizeStep(None, None, max_length=max_length, train_on=train_on, tokenized=tokenized, mix=mix)
    stream = _example_stream(step, seed=seed, shuffle=shuffle, num_epochs=1, worker_count=0, unchunk=False)
    return sum(1 for _ in packed_batches(stream, plan, seed=seed, stats=None, rows_to_batch=len))
  if batching == "bucketed_packed":  # in the epoch's order, as the batcher packs
    return sum(packed_batches_per_shape(epoch_lengths(tokenized, seed=seed, shuffle=shuffle, mix=mix), plan.bucket_lengths,
                                        dict(zip(plan.bucket_lengths, plan.batch_sizes)).__getitem__).values())
  if mix is not None:  # the examples of the mix's first epoch
    lengths = epoch_lengths(tokenized, seed=seed, shuffle=shuffle, mix=mix)
  if plan.bucket_lengths is None:  # dynamic: one queue
    return -(-len(lengths) // plan.batch_sizes[0])
  per_bucket = np.bincount(bucket_index(lengths, plan.bucket_lengths), minlength=len(plan.bucket_lengths))
  return int(sum(-(-int(n) // size) for n, size in zip(per_bucket, plan.batch_sizes)))
