"""Length-grouped batching as a Grain transformation: fixed-shape padded batches per bucket.

With `BatchPlan.packed`, each bucket is a width whose batches are B rows of packed examples
(`rows.WidthPacker` decides the rows and when a width's batch is complete, `rows.packed_batch`
builds it).

`BucketBatchIterDataset` reads the tokenized stream (`pipeline.make_batches`), puts each example
in the queue of its (epoch, bucket) and emits a batch when a queue reaches its bucket's batch
size. Dynamic batching is the same with one queue per epoch and T = the batch maximum; static
is one bucket of max_length.

Examples dropped by truncation (no trained token left) arrive as markers, so the batcher, which
runs in the main process even with workers, counts them (`PipelineStats`) and knows an epoch is
complete once all N of its elements arrived (workers may interleave the end of one epoch with the
start of the next). It then flushes that epoch's leftovers as padded fixed-shape batches: partial
batches are padded with fill rows, never dropped, and no batch mixes epochs.

Checkpointing: the batcher's state is `{"anchor": parent state when its queues were last empty,
"anchor_seen": elements seen per unfinished epoch then, "consumed": elements read since, "emitted": batches emitted since, "exhausted": bool}`;
`set_state` restores the parent to the anchor and replays `consumed` elements through the queues
(no collation) to rebuild them exactly. Queues are empty at least at every epoch end, so a restore
replays at most one epoch of (pre-tokenized or re-tokenized) examples. The state is JSON-serializable.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import grain
import numpy as np

from jaxsft.data.collate import bucket_index, collate, round_up
from jaxsft.data.pipeline_stats import PipelineStats
from jaxsft.data.rows import WidthPacker, packed_batch


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
  packed: bool = False  # bucketed packing: each bucket is a width whose batch is B packed rows (rows.WidthPacker)

  def queue_of(self, length: int) -> int:
    return 0 if self.bucket_lengths is None else bucket_index(length, self.bucket_lengths)

  def collate(self, queue: int, examples: list) -> dict:
    """A batch of queue `queue`'s examples (packed: its rows, `rows.Row`s of examples)."""
    if self.packed:
      return packed_batch([row.items for row in examples], batch_size=self.batch_sizes[queue],
                          width=self.bucket_lengths[queue], pad_token_id=self.pad_token_id)
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


class _EpochBucketQueues:
  """Per-(epoch, bucket) queues: `add` returns the batches that became full, `flush(epoch)` the
  leftovers of an epoch. Items are `(epoch, queue, examples)`; packed, one `rows.WidthPacker` per
  epoch holds the queues and an item's examples are its rows."""

  def __init__(self, plan: BatchPlan):
    self.plan = plan
    self.queues: dict[int, list[list[dict]]] = {}
    self.packers: dict[int, WidthPacker] = {}

  def add(self, example: dict) -> list[tuple[int, int, list]]:
    epoch = int(example["epoch"])
    if self.plan.packed:
      packer = self.packers.setdefault(epoch, WidthPacker(self.plan.bucket_lengths, self.plan.batch_sizes))
      return [(epoch, q, rows) for q, rows in packer.add(len(example["input_ids"]), example)]
    q = self.plan.queue_of(len(example["input_ids"]))
    queues = self.queues.setdefault(epoch, [[] for _ in self.plan.batch_sizes])
    queues[q].append(example)
    if len(queues[q]) == self.plan.batch_sizes[q]:
      full, queues[q] = queues[q], []
      return [(epoch, q, full)]
    return []

  def flush(self, epoch: int) -> list[tuple[int, int, list]]:
    if epoch in self.packers:
      return [(epoch, q, rows) for q, rows in self.packers.pop(epoch).flush()]
    queues = self.queues.pop(epoch, [])
    return [(epoch, q, items) for q, items in enumerate(queues) if items]

  def flush_all(self) -> list[tuple[int, int, list]]:
    return [item for epoch in sorted(set(self.queues) | set(self.packers)) for item in self.flush(epoch)]

  def empty(self) -> bool:
    return (not any(any(queues) for queues in self.queues.values())
            and all(packer.empty() for packer in self.packers.values()))


def _row_sources(items: list, packed: bool) -> list | None:
  """The sources of each row's examples (a mix's examples name theirs), None without a mix."""
  rows = [row.items for row in items] if packed else [[example] for example in items]
  if not rows or "source" not in rows[0][0]:
    return None
  return [[example["source"] for example in row] for row in rows]


class BucketBatchDatasetIterator(grain.DatasetIterator):
  """Iterator of `BucketBatchIterDataset`; see the module docstring for its state."""

  def __init__(self, parent: grain.DatasetIterator, plan: BatchPlan, stats: PipelineStats | None):
    super().__init__(parent)
    self._plan, self._stats_out = plan, stats
    self._restart(copy.deepcopy(self._parent.get_state()), {})

  def _restart(self, anchor, seen: dict[int, int]) -> None:
    self._queues = _EpochBucketQueues(self._plan)
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
    stats = None if replay else self._stats_out  # replayed elements were counted before the checkpoint
    for element in element if isinstance(element, list) else [element]:  # workers send chunks
      if stats is not None:
        stats.count_example(element, self._plan.max_length)
      epoch = int(element["epoch"])
      if "input_ids" in element:
        self._ready.extend(self._queues.add(element))
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
      real_rows = int((batch["attention_mask"].any(axis=1)).sum()) if self._plan.packed else len(items)
      self._stats_out.count_batch(batch, real_rows, _row_sources(items, self._plan.packed))
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
