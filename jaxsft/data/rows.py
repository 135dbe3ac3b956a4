"""Rows packed first-fit: `FirstFitRows` places examples by length, `pack_rows` builds a packed
batch. Shared by the bucket batcher (bucketing.py, bucketed packing) and the width choice (choose.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxsft.labels import IGNORE_INDEX


class FirstFitRows:
  """`rows` rows of `width` tokens filled first-fit: `place(length)` puts an example in the first
  row with room and returns its row index, or None when no row has room."""

  def __init__(self, rows: int, width: int):
    self.width, self.fill = width, [0] * rows

  def place(self, length: int) -> int | None:
    for i, used in enumerate(self.fill):
      if used + length <= self.width:
        self.fill[i] = used + length
        return i
    return None

  @property
  def rows_used(self) -> int:
    return sum(1 for used in self.fill if used)


def pack_rows(examples: Sequence[dict], *, rows: int, width: int, pad_token_id: int) -> dict:
  """Examples placed first-fit, in order, into `rows` rows of `width` tokens: `input_ids`,
  `attention_mask`, `labels`, `segment_ids` (1, 2, ... per example in a row, 0 on padding) and
  `positions` (restarting at 0 in every segment), int32 (rows, width). Each segment's first label
  is -100 (nothing is predicted across a boundary); rows left empty are fill rows. Raises
  ValueError when the examples do not fit."""
  input_ids = np.full((rows, width), pad_token_id, dtype=np.int32)
  labels = np.full((rows, width), IGNORE_INDEX, dtype=np.int32)
  segment_ids = np.zeros((rows, width), dtype=np.int32)
  positions = np.zeros((rows, width), dtype=np.int32)
  bins, segments = FirstFitRows(rows, width), [0] * rows
  for example in examples:
    ids = np.asarray(example["input_ids"])
    row = bins.place(len(ids))
    if row is None:
      raise ValueError(f"{len(examples)} examples do not fit first-fit in {rows} rows of {width} tokens")
    start, segments[row] = bins.fill[row] - len(ids), segments[row] + 1
    at = slice(start, start + len(ids))
    input_ids[row, at], labels[row, at] = ids, example.get("labels", ids)
    segment_ids[row, at], positions[row, at] = segments[row], np.arange(len(ids))
    labels[row, start] = IGNORE_INDEX
  return {"input_ids": input_ids, "attention_mask": (segment_ids > 0).astype(np.int32), "labels": labels,
          "segment_ids": segment_ids, "positions": positions}
