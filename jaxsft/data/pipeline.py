"""Records to batches with Grain: shuffle per epoch, tokenize, then bucket/dynamic/static/packed.

    MapDataset.range(N) -> shuffle(seed) -> repeat(num_epochs) -> map_with_index(tokenize)
      -> to_iter_dataset -> [mp_prefetch(worker_count)] -> BucketBatchIterDataset | FirstFit packing

`MapDataset.repeat` reseeds the shuffle every epoch, so epoch e is a permutation drawn from
(seed, e). Every element carries its epoch; examples dropped by truncation (no trained token
left) travel on as markers, so the batcher, which runs in the main process even with workers,
counts them (`PipelineStats`) and knows an epoch is complete once all N of its elements arrived
(workers may interleave the end of one epoch with the start of the next). It then flushes that
epoch's leftovers as padded fixed-shape batches: partial batches are padded, never dropped, and no batch
mixes epochs (except in packed mode, where grain's packer may put the last examples of one epoch
and the first of the next into one packed batch).

Batch sizes: `batch_size` rows per batch, or with `tokens_per_batch` B_k = tokens_per_batch // T_k
rounded down to a multiple of `batch_multiple_of` (at least one multiple). Every batch also has
`"epoch"` (0-d int32).

Multi-host (`shard_by_process=True`): every JAX process runs the same pipeline over all records
and keeps rows [i*B/P, (i+1)*B/P) of each global batch (P processes from grain's
`ShardByJaxProcess`), so all processes step through identical shapes in lockstep. `batch_size`,
`tokens_per_batch` and `batch_shapes` are global.

With workers, each worker tokenizes its slice of the stream and sends chunks of 32 examples
(grain's `batch` with `batch_fn=list` before `mp_prefetch`; the bucket batcher reads the chunks,
packed mode unchunks them with `FlatMapIterDataset`).

Checkpointing: the batcher's state is `{"anchor": parent state when its queues were last empty,
"anchor_seen": elements seen per unfinished epoch then, "consumed": elements read since, "emitted": batches emitted since, "exhausted": bool}`;
`set_state` restores the parent to the anchor and replays `consumed` elements through the queues
(no collation) to rebuild them exactly. Queues are empty at least at every epoch end, so a restore
replays at most one epoch of (cached or re-tokenized) examples. The state is JSON-serializable.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import weakref
from typing import Any, Sequence

import grain
import numpy as np

from jaxsft.data.collate import IGNORE_INDEX, choose_buckets, collate, round_up
from jaxsft.data.tokenize import _finish, _backend, render_with_spans, tokenize_records

BATCHING = ("static", "dynamic", "bucketed", "packed")


@dataclasses.dataclass
class PipelineStats:
  """Counters the pipeline updates in place as batches are emitted (main process only).

  `examples` tokenized examples seen (all epochs), `truncated` longer than max_length (cut),
  `dropped` left with no trained token after truncation (not batched), `batches`, `rows`
  (including `fill_rows`, all-padding rows), `real_tokens` (attention_mask 1), `padded_tokens`
  (B*T summed), `label_tokens` (labels != -100). Batches restored by `set_state` replay are not
  counted again.
  """

  examples: int = 0
  truncated: int = 0
  dropped: int = 0
  batches: int = 0
  rows: int = 0
  fill_rows: int = 0
  real_tokens: int = 0
  padded_tokens: int = 0
  label_tokens: int = 0
  dropped_per_epoch: dict = dataclasses.field(default_factory=dict)

  @property
  def waste_frac(self) -> float:
    return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

  def count_batch(self, batch: dict, num_real_rows: int) -> None:
    self.batches += 1
    self.rows += batch["input_ids"].shape[0]
    self.fill_rows += batch["input_ids"].shape[0] - num_real_rows
    self.real_tokens += int(batch["attention_mask"].sum())
    self.padded_tokens += batch["input_ids"].size
    self.label_tokens += int((batch["labels"] != IGNORE_INDEX).sum())

  def summary(self) -> str:
    return (f"{self.examples} examples ({self.truncated} truncated, {self.dropped} dropped: no trained "
            f"token left), {self.batches} batches, {self.fill_rows} fill rows, "
            f"{self.padded_tokens} padded tokens ({100 * self.waste_frac:.1f}% padding)")


# ---------------------------------------------------------------------------------------------
# Tokenization, cached on the records object so make_batches and batch_shapes tokenize once.

# id(records) -> (weakref to records, {(id(tokenizer), max_length, train_on): (tokenizer, examples, lengths)})
_TOKEN_CACHE: dict[int, tuple[Any, dict]] = {}


def _cache_slot(records) -> dict | None:
  """The cache dict of a records object, or None for objects without weak references (plain lists)."""
  entry = _TOKEN_CACHE.get(id(records))
  if entry is not None and entry[0]() is records:
    return entry[1]
  try:
    ref = weakref.ref(records, lambda _, key=id(records): _TOKEN_CACHE.pop(key, None))
  except TypeError:
    return None
  _TOKEN_CACHE[id(records)] = (ref, {})
  return _TOKEN_CACHE[id(records)][1]


def _cached(records, tokenizer, max_length, train_on):
  slot = _cache_slot(records)
  hit = None if slot is None else slot.get((id(tokenizer), max_length, train_on))
  return (hit[1], hit[2]) if hit is not None and hit[0] is tokenizer else None


def tokenized(records: Sequence[dict], tokenizer, *, max_length: int, train_on: str = "all_assistant"):
  """`tokenize_records(...)`, cached per records object (a `load_records` result) and settings, so
  `batch_shapes` and `make_batches` tokenize once. Records are treated as immutable once tokenized.
  """
  hit = _cached(records, tokenizer, max_length, train_on)
  if hit is not None:
    return hit
  examples, full_lengths = tokenize_records(tokenizer, records, max_length=max_length, train_on=train_on)
  slot = _cache_slot(records)
  if slot is not None:
    slot[(id(tokenizer), max_length, train_on)] = (tokenizer, examples, full_lengths)
  return examples, full_lengths


class _TokenizeStep:
  """map_with_index(index, record_index) -> example dict with epoch bookkeeping.

  Uses the pre-tokenized examples when given, else tokenizes (in the worker processes when
  `worker_count > 0`).
  """

  def __init__(self, records, tokenizer, *, max_length, train_on, examples=None, full_lengths=None):
    self.records, self.tokenizer, self.max_length, self.train_on = records, tokenizer, max_length, train_on
    self.examples, self.full_lengths = examples, full_lengths

  def __call__(self, index: int, record_index: int) -> dict:
    n = len(self.records)
    record_index = int(record_index)
    if self.examples is not None:
      example, full_length = self.examples[record_index], int(self.full_lengths[record_index])
    else:
      try:
        text, spans = render_with_spans(self.tokenizer, self.records[record_index], train_on=self.train_on)
        enc = _backend(self.tokenizer).encode(text, add_special_tokens=False)
        example, full_length = _finish(enc.ids, enc.offsets, spans, self.max_length)
      except ValueError as e:
        raise ValueError(f"record {record_index}: {e}") from None
    out = dict(example) if example is not None else {}
    out.update(epoch=index // n, full_length=full_length)
    return out


# ---------------------------------------------------------------------------------------------
# Length-grouped bucket batching as a Grain transformation.


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """How examples become batches. `bucket_lengths=None` means dynamic (one queue, T = batch
  maximum rounded up to `pad_to_multiple_of`, capped at max_length)."""

  bucket_lengths: tuple[int, ...] | None
  batch_sizes: tuple[int, ...]
  max_length: int
  pad_to_multiple_of: int
  pad_token_id: int
  epoch_size: int = 0  # records per epoch: an epoch is complete once this many elements arrived
  shard_index: int = 0
  shard_count: int = 1

  def queue_of(self, length: int) -> int:
    if self.bucket_lengths is None:
      return 0
    i = int(np.searchsorted(self.bucket_lengths, length, side="left"))
    if i == len(self.bucket_lengths):
      raise ValueError(f"an example of {length} tokens fits no bucket (largest {self.bucket_lengths[-1]})")
    return i

  def collate(self, queue: int, examples: list[dict]) -> dict:
    if self.bucket_lengths is None:
      longest = max(len(e["input_ids"]) for e in examples)
      width = min(round_up(longest, self.pad_to_multiple_of), self.max_length)
    else:
      width = self.bucket_lengths[queue]
    return collate(examples, pad_token_id=self.pad_token_id, bucket_lengths=[width],
                   batch_size=self.batch_sizes[queue])

  def shard_rows(self, batch: dict) -> dict:
    if self.shard_count == 1:
      return batch
    rows = batch["input_ids"].shape[0] // self.shard_count
    sl = slice(self.shard_index * rows, (self.shard_index + 1) * rows)
    return {k: (v[sl] if np.ndim(v) else v) for k, v in batch.items()}


class _Queues:
  """Per-(epoch, bucket) queues: `add` returns the batches that became full, `flush(epoch)` the
  leftovers of an epoch. Items are `(epoch, queue, examples)`."""

  def __init__(self, plan: BatchPlan):
    self.plan = plan
    self.queues: dict[int, list[list[dict]]] = {}

  def add(self, example: dict) -> list[tuple[int, int, list[dict]]]:
    epoch, q = int(example["epoch"]), self.plan.queue_of(len(example["input_ids"]))
    queues = self.queues.setdefault(epoch, [[] for _ in self.plan.batch_sizes])
    queues[q].append(example)
    if len(queues[q]) == self.plan.batch_sizes[q]:
      full, queues[q] = queues[q], []
      return [(epoch, q, full)]
    return []

  def flush(self, epoch: int) -> list[tuple[int, int, list[dict]]]:
    queues = self.queues.pop(epoch, [])
    return [(epoch, q, items) for q, items in enumerate(queues) if items]

  def flush_all(self) -> list[tuple[int, int, list[dict]]]:
    return [item for epoch in sorted(self.queues) for item in self.flush(epoch)]

  def empty(self) -> bool:
    return not any(any(queues) for queues in self.queues.values())


class BucketBatchDatasetIterator(grain.DatasetIterator):
  """Iterator of `BucketBatchIterDataset`; see the module docstring for its state."""

  def __init__(self, parent: grain.DatasetIterator, plan: BatchPlan, stats: PipelineStats | None):
    super().__init__(parent)
    self._plan, self._stats_out = plan, stats
    self._restart(copy.deepcopy(self._parent.get_state()), {})

  def _restart(self, anchor, seen: dict[int, int]) -> None:
    self._queues = _Queues(self._plan)
    self._ready: collections.deque = collections.deque()
    self._seen = dict(seen)  # elements arrived per unfinished epoch
    self._anchor, self._anchor_seen = anchor, dict(seen)
    self._consumed, self._emitted, self._exhausted = 0, 0, False

  def _pull(self, *, replay: bool) -> None:
    """Reads one element into the queues; at the end of the parent, flushes them."""
    try:
      element = next(self._parent)
    except StopIteration:
      self._exhausted = True
      self._ready.extend(self._queues.flush_all())
      return
    self._consumed += 1
    stats = None if replay else self._stats_out
    for element in element if isinstance(element, list) else [element]:  # workers send chunks
      if stats is not None:
        stats.examples += 1
        stats.truncated += element["full_length"] > self._plan.max_length
      epoch = int(element["epoch"])
      if "input_ids" in element:
        self._ready.extend(self._queues.add(element))
      elif stats is not None:
        stats.dropped += 1
        stats.dropped_per_epoch[epoch] = stats.dropped_per_epoch.get(epoch, 0) + 1
      # Workers may interleave the ends of two epochs: an epoch is done when all its elements arrived.
      self._seen[epoch] = self._seen.get(epoch, 0) + 1
      if self._seen[epoch] == self._plan.epoch_size:
        del self._seen[epoch]
        self._ready.extend(self._queues.flush(epoch))

  def __next__(self) -> dict:
    while not self._ready:
      if self._exhausted:
        raise StopIteration
      self._pull(replay=False)
    epoch, q, items = self._ready.popleft()
    self._emitted += 1
    batch = self._plan.collate(q, items)
    if self._stats_out is not None:
      self._stats_out.count_batch(batch, len(items))
    batch["epoch"] = np.asarray(epoch, dtype=np.int32)
    if not self._ready and self._queues.empty() and not self._exhausted:
      self._restart(copy.deepcopy(self._parent.get_state()), self._seen)  # nothing buffered: a cheap anchor
    return self._plan.shard_rows(batch)

  def get_state(self) -> dict:
    return {"anchor": copy.deepcopy(self._anchor), "anchor_seen": [[e, n] for e, n in self._anchor_seen.items()],
            "consumed": self._consumed, "emitted": self._emitted, "exhausted": self._exhausted}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(copy.deepcopy(state["anchor"]))
    self._restart(copy.deepcopy(state["anchor"]), {int(e): int(n) for e, n in state["anchor_seen"]})
    for _ in range(state["consumed"]):
      self._pull(replay=True)
    if state["exhausted"]:
      self._pull(replay=True)
      if not self._exhausted:
        raise ValueError("set_state: the parent was exhausted in the saved state but is not on replay")
    if self._consumed != state["consumed"] or len(self._ready) < state["emitted"]:
      raise ValueError("set_state: replay did not reproduce the saved state (was the data changed?)")
    for _ in range(state["emitted"]):
      self._ready.popleft()
    self._emitted = state["emitted"]

  def __str__(self) -> str:
    return f"BucketBatchDatasetIterator(buckets={self._plan.bucket_lengths}, sizes={self._plan.batch_sizes})"


class BucketBatchIterDataset(grain.IterDataset):
  """Groups examples by length into per-bucket queues and emits fixed-shape padded batches.

  Queues are per (epoch, bucket). A queue that reaches its batch size emits a batch; once all
  `plan.epoch_size` elements of an epoch arrived (or the parent ends), that epoch's queues are
  flushed as padded batches with fill rows.
  """

  def __init__(self, parent: grain.IterDataset, plan: BatchPlan, stats: PipelineStats | None = None):
    super().__init__(parent)
    self._plan, self._stats_out = plan, stats

  def __iter__(self) -> BucketBatchDatasetIterator:
    return BucketBatchDatasetIterator(self._parent.__iter__(), self._plan, self._stats_out)

  def __str__(self) -> str:
    return f"BucketBatchIterDataset(buckets={self._plan.bucket_lengths}, sizes={self._plan.batch_sizes})"


# ---------------------------------------------------------------------------------------------
# Packed mode: grain's first-fit packing to max_length.


class _KeepTokenized:
  """Filter that keeps tokenized examples and counts the dropped ones (runs in the main process)."""

  def __init__(self, stats: PipelineStats | None, max_length: int):
    self.stats, self.max_length = stats, max_length

  def __call__(self, element: dict) -> bool:
    if self.stats is not None:
      self.stats.examples += 1
      self.stats.truncated += element["full_length"] > self.max_length
      if "input_ids" not in element:
        self.stats.dropped += 1
        e = int(element["epoch"])
        self.stats.dropped_per_epoch[e] = self.stats.dropped_per_epoch.get(e, 0) + 1
    return "input_ids" in element


class _PackedRowsToBatch:
  """grain batch_fn: packed rows -> contract batch (+ fill rows, per-process row slice)."""

  def __init__(self, plan: BatchPlan, stats: PipelineStats | None):
    self.plan, self.stats = plan, stats

  def __call__(self, rows: Sequence[dict]) -> dict:
    size, width = self.plan.batch_sizes[0], self.plan.max_length
    input_ids = np.full((size, width), self.plan.pad_token_id, dtype=np.int32)
    labels = np.full((size, width), IGNORE_INDEX, dtype=np.int32)
    segment_ids = np.zeros((size, width), dtype=np.int32)
    positions = np.zeros((size, width), dtype=np.int32)
    for i, row in enumerate(rows):
      input_ids[i], labels[i] = row["input_ids"], row["labels"]
      segment_ids[i], positions[i] = row["input_ids_segment_ids"], row["input_ids_positions"]
    labels[(positions == 0) | (segment_ids == 0)] = IGNORE_INDEX  # nothing predicted across a boundary
    batch = {"input_ids": input_ids, "attention_mask": (segment_ids > 0).astype(np.int32), "labels": labels,
             "segment_ids": segment_ids, "positions": positions,
             "epoch": np.asarray(max(max(row["epoch"]) for row in rows), dtype=np.int32)}
    if self.stats is not None:
      self.stats.count_batch(batch, len(rows))
    return self.plan.shard_rows(batch)


# ---------------------------------------------------------------------------------------------
# Entry points.


_IPC_CHUNK = 32


class _Unchunk(grain.experimental.FlatMapTransform):
  max_fan_out = _IPC_CHUNK

  def flat_map(self, chunk):
    return chunk


def _batch_size_for(width: int, *, batch_size: int, tokens_per_batch: int | None, multiple: int) -> int:
  if tokens_per_batch is None:
    return batch_size
  size = (tokens_per_batch // width) // multiple * multiple
  return max(size, multiple)


def _plan(records, tokenizer, *, lengths, max_length, batching, bucket_lengths, num_buckets, batch_size,
          tokens_per_batch, pad_to_multiple_of, batch_multiple_of, shard_by_process, train_on):
  """Resolves the configuration to a BatchPlan (+ cached examples when lengths were needed)."""
  if batching not in BATCHING:
    raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
  if max_length < 1 or batch_size < 1:
    raise ValueError(f"max_length and batch_size must be positive, got {max_length}, {batch_size}")
  shard_index, shard_count = 0, 1
  if shard_by_process:
    shard = grain.sharding.ShardByJaxProcess()
    shard_index, shard_count = shard.shard_index, shard.shard_count
  multiple = math.lcm(max(batch_multiple_of, 1), shard_count)
  if tokens_per_batch is None and batch_size % multiple:
    raise ValueError(f"batch_size {batch_size} must be a multiple of batch_multiple_of x processes = {multiple}")
  if tokens_per_batch is not None and batching == "dynamic":
    raise ValueError("tokens_per_batch needs a fixed T per batch: use static, bucketed or packed batching")
  examples = full_lengths = None
  pad_token_id = tokenizer.pad_token_id if tokenizer is not None else 0
  if pad_token_id is None:
    pad_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
  size = lambda width: _batch_size_for(width, batch_size=batch_size, tokens_per_batch=tokens_per_batch,
                                       multiple=multiple)
  common = dict(max_length=max_length, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id,
                epoch_size=len(records) if records is not None else 0, shard_index=shard_index,
                shard_count=shard_count)
  if batching == "bucketed":
    if bucket_lengths is None:
      if lengths is None:
        examples, full_lengths = tokenized(records, tokenizer, max_length=max_length, train_on=train_on)
        lengths = [len(e["input_ids"]) for e in examples if e is not None]
      buckets = choose_buckets(np.minimum(lengths, max_length), num_buckets, multiple_of=pad_to_multiple_of,
                               max_length=max_length)
    else:
      buckets = sorted(int(b) for b in bucket_lengths)
      if buckets[-1] < max_length:
        raise ValueError(f"the largest bucket ({buckets[-1]}) must be >= max_length ({max_length}): "
                         "examples are truncated to max_length, not to the largest bucket")
    return BatchPlan(tuple(buckets), tuple(size(b) for b in buckets), **common), examples, full_lengths
  if batching == "dynamic":
    return BatchPlan(None, (size(max_length),), **common), None, None
  return BatchPlan((max_length,), (size(max_length),), **common), None, None  # static, packed


def make_batches(records: Sequence[dict], tokenizer, *, max_length: int, batching: str = "bucketed",
                 bucket_lengths: Sequence[int] | None = None, num_buckets: int = 8, batch_size: int = 8,
                 tokens_per_batch: int | None = None, pad_to_multiple_of: int = 8, batch_multiple_of: int = 1,
                 seed: int = 0, shuffle: bool = True, num_epochs: int | None = 1,
                 train_on: str = "all_assistant", worker_count: int = 0, shard_by_process: bool = False,
                 stats: PipelineStats | None = None) -> grain.IterDataset:
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
      pad_to_multiple_of), "bucketed" (T = the example's bucket) or "packed" (first-fit packing into
      rows of max_length with segment ids and per-segment positions).
    bucket_lengths: bucket boundaries; None chooses `num_buckets` of them with `choose_buckets` over
      the tokenized lengths (tokenizing every record once, cached for the pipeline).
    batch_size / tokens_per_batch: rows per batch, or a token budget B_k = tokens_per_batch // T_k.
    batch_multiple_of: every batch size is a multiple of it (the data-parallel degree).
    seed, shuffle, num_epochs: epoch e is shuffled with a seed derived from (seed, e); None repeats
      forever.
    train_on: "all_assistant" or "last".
    worker_count: > 0 tokenizes in that many processes (`mp_prefetch`).
    shard_by_process: each JAX process keeps its rows of every global batch.
    stats: a `PipelineStats` updated in place; also reachable as the returned dataset's `.stats`.
  """
  if not len(records):
    raise ValueError("make_batches needs at least one record")
  stats = stats if stats is not None else PipelineStats()
  plan, examples, full_lengths = _plan(
      records, tokenizer, lengths=None, max_length=max_length, batching=batching, bucket_lengths=bucket_lengths,
      num_buckets=num_buckets, batch_size=batch_size, tokens_per_batch=tokens_per_batch,
      pad_to_multiple_of=pad_to_multiple_of, batch_multiple_of=batch_multiple_of,
      shard_by_process=shard_by_process, train_on=train_on)
  if examples is None:  # reuse a cached tokenization when there is one
    hit = _cached(records, tokenizer, max_length, train_on)
    if hit is not None:
      examples, full_lengths = hit
  step = _TokenizeStep(records, tokenizer, max_length=max_length, train_on=train_on, examples=examples,
                       full_lengths=full_lengths)
  ds = grain.MapDataset.range(len(records))
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs).map_with_index(step)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0 if examples is not None else 2, prefetch_buffer_size=64))
  if worker_count > 0:
    from absl import flags  # grain's workers read absl flags; unparsed flags raise there

    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    # Workers send chunks of examples: per-element inter-process traffic costs more than tokenizing,
    # and small arrays are cheaper pickled than in one shared-memory segment each.
    it = it.batch(_IPC_CHUNK, batch_fn=list)
    it = grain.experimental.WithOptionsIterDataset(it, grain.experimental.DatasetOptions(min_shm_size=1 << 20))
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    if batching == "packed":  # the bucket batcher reads chunks itself; the packer wants examples
      it = grain.experimental.FlatMapIterDataset(it, _Unchunk())
  if batching == "packed":
    it = it.filter(_KeepTokenized(stats, max_length))
    it = grain.experimental.FirstFitPackIterDataset(
        it, length_struct={"input_ids": max_length, "labels": max_length}, num_packing_bins=plan.batch_sizes[0],
        seed=seed, shuffle_bins=False, meta_features=("epoch",),
        padding_struct={"input_ids": plan.pad_token_id, "labels": IGNORE_INDEX})
    out = it.batch(plan.batch_sizes[0], drop_remainder=False, batch_fn=_PackedRowsToBatch(plan, stats))
  else:
    out = BucketBatchIterDataset(it, plan, stats)
  out.stats, out.plan = stats, plan
  return out


def batch_shapes(records: Sequence[dict] | None = None, tokenizer=None, *, lengths: Sequence[int] | None = None,
                 max_length: int, batching: str = "bucketed", bucket_lengths: Sequence[int] | None = None,
                 num_buckets: int = 8, batch_size: int = 8, tokens_per_batch: int | None = None,
                 pad_to_multiple_of: int = 8, batch_multiple_of: int = 1, train_on: str = "all_assistant",
                 shard_by_process: bool = False, **_ignored) -> list[tuple[int, int]]:
  """Every global (B, T) `make_batches` with the same arguments can emit, sorted.

  Accepts (and ignores) make_batches' other arguments (seed, shuffle, num_epochs, worker_count,
  stats), so a trainer can pass one config dict to both. Bucketed without `bucket_lengths` needs
  `records` + `tokenizer` (the tokenization is cached for make_batches) or the token `lengths`.
  Dynamic lists every T = multiple of pad_to_multiple_of up to max_length (and max_length).
  """
  plan, _, _ = _plan(records, tokenizer, lengths=lengths, max_length=max_length, batching=batching,
                     bucket_lengths=bucket_lengths, num_buckets=num_buckets, batch_size=batch_size,
                     tokens_per_batch=tokens_per_batch, pad_to_multiple_of=pad_to_multiple_of,
                     batch_multiple_of=batch_multiple_of, shard_by_process=shard_by_process, train_on=train_on)
  if plan.bucket_lengths is None:
    m = max(pad_to_multiple_of, 1)
    widths = sorted({min(w, max_length) for w in range(m, max_length + m, m)})
    return [(plan.batch_sizes[0], w) for w in widths]
  return sorted(zip(plan.batch_sizes, plan.bucket_lengths))
