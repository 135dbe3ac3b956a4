"""Packed modes: grain's first-fit packing of examples into rows of max_length, and bucketed
packing (rows of a few widths, filled by `rows.WidthPacker` in the bucket batcher).

Each row holds several examples back to back; a batch is B such rows with `segment_ids`
(1, 2, ... per example, 0 on padding) and `positions` (restarting at 0 in every segment), so the
model attends within a segment only. The first label of every segment and every padding label are
-100: nothing is predicted across a segment boundary. The filter that drops (and counts) the
examples truncation emptied runs in the main process, before the packer.

Bucketed packing puts each example best-fit into an open row of a width that holds it, or opens a
row in the narrowest such width (long examples in wide rows, short ones in their gaps or in narrow
rows); `bucketing.BucketBatchIterDataset` keeps one `rows.WidthPacker` per epoch, which emits a
width's B fullest rows as a batch when it needs room and packs the epoch's leftover rows again at
its end, so every width is one (B, T) shape, and no batch mixes epochs.

Unlike the bucket batcher, grain's packer may put the last examples of one epoch and the first of
the next into one packed batch; a batch's `epoch` is the latest epoch in it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import grain
import numpy as np

from jaxsft.data.bucketing import BatchPlan
from jaxsft.data.pipeline_stats import PipelineStats
from jaxsft.labels import IGNORE_INDEX


class _KeepTokenized:
  """Filter that keeps tokenized examples and counts the dropped ones (runs in the main process)."""

  def __init__(self, stats: PipelineStats | None, max_length: int):
    self.stats, self.max_length = stats, max_length

  def __call__(self, element: dict) -> bool:
    if self.stats is not None:
      self.stats.count_example(element, self.max_length)
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
      self.stats.count_batch(batch, len(rows), [row["source"] for row in rows] if "source" in rows[0] else None)
    return self.plan.shard_rows(batch)


def packed_batches(examples: grain.IterDataset, plan: BatchPlan, *, seed: int, stats: PipelineStats | None,
                   rows_to_batch: Callable[[Sequence[dict]], object] | None = None,
                   sources: bool = False) -> grain.IterDataset:
  """Drops the emptied examples, packs the rest into rows of `plan.max_length` and groups
  `plan.batch_sizes[0]` rows per batch (the last batch gets fill rows).

  `rows_to_batch` replaces the collation (e.g. `len`, to count batches without building them).
  `sources`: the examples name their `source` (a mix), which each row keeps per segment.
  """
  kept = examples.filter(_KeepTokenized(stats, plan.max_length))
  rows = grain.experimental.FirstFitPackIterDataset(
      kept, length_struct={"input_ids": plan.max_length, "labels": plan.max_length},
      num_packing_bins=plan.batch_sizes[0], seed=seed, shuffle_bins=False,
      meta_features=("epoch", "source") if sources else ("epoch",),
      padding_struct={"input_ids": plan.pad_token_id, "labels": IGNORE_INDEX})
  return rows.batch(plan.batch_sizes[0], drop_remainder=False,
                    batch_fn=rows_to_batch if rows_to_batch is not None else _PackedRowsToBatch(plan, stats))
