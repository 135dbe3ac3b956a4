"""Rows of a few widths for bucketed packing: `WidthPacker` decides which examples share a row and
when a width's batch is complete, `packed_batch` builds one batch's arrays, `packed_batches_per_shape`
counts the batches it makes. Shared by the bucket batcher (bucketing.py) and the batch counts (the
pipeline's `count_batches` and the cost model's, `jaxsft.collation.plans`), so what is counted and
priced is what the pipeline emits.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from jaxsft.labels import IGNORE_INDEX


@dataclasses.dataclass
class Row:
  """One packed row: the tokens it holds (`used`) and its items, in the order they were placed."""

  used: int = 0
  items: list = dataclasses.field(default_factory=list)

  def add(self, length: int, items: list) -> None:
    self.used += length
    self.items.extend(items)


class WidthPacker:
  """Packs items by length into rows of `widths` (ascending), `batch_sizes[k]` = B_k rows a batch.

  Each width W_k keeps at most `pool`·B_k open rows. An item of length L goes into the open row, of
  any width >= L, that it leaves the least room in (best fit; narrower width, then earlier row, on
  ties), so short items fill the gaps of wide rows. Where no row has room it opens a row in the
  narrowest width W_k >= L; if W_k already has pool·B_k open rows, its B_k fullest are first
  emitted as a batch. A batch leaves with the fullest rows while the others go on filling (with
  pool = 1 a width's batch would leave as soon as one item fits in none of its rows).

  `flush()` ends the epoch. Its open rows, whole, fullest first and widest width first, are packed
  again best-fit: into an open row of a width >= their fill, else into a new row of the narrowest
  width that holds them; and a width's last partial batch takes narrower rows into its fill rows
  instead of leaving them a batch of their own. So an epoch ends in at most one partial batch a
  width, often fewer.

  `add` and `flush` return the batches that became complete, as `(k, rows)` with at most B_k rows.
  """

  def __init__(self, widths: Sequence[int], batch_sizes: Sequence[int], pool: int = 2):
    self.widths, self.batch_sizes = [int(w) for w in widths], [int(b) for b in batch_sizes]
    if self.widths != sorted(set(self.widths)) or len(self.widths) != len(self.batch_sizes):
      raise ValueError(f"widths must ascend without repeats, one batch size each: {widths}, {batch_sizes}")
    self.pool = pool
    # Every open row as (room left, k, serial, row), ascending: the best fit for L is the first entry
    # with room >= L. A row narrower than W_k has less room than L, so no width test is needed.
    self._by_room: list[tuple[int, int, int, Row]] = []
    self._open_count = [0] * len(self.widths)  # open rows per width (a count of _by_room's, kept for speed)
    self._serial = 0

  def open_rows(self, k: int) -> list[Row]:
    """Width k's open rows, in the order they were opened."""
    return [row for _, j, _, row in sorted(self._by_room, key=lambda entry: entry[2]) if j == k]

  def narrowest(self, length: int) -> int:
    for k, width in enumerate(self.widths):
      if length <= width:
        return k
    raise ValueError(f"an item of {length} tokens is wider than the widest row ({self.widths[-1]})")

  def add(self, length: int, item: Any) -> list[tuple[int, list[Row]]]:
    at = bisect.bisect_left(self._by_room, (length,))
    if at < len(self._by_room):
      room, k, serial, row = self._by_room.pop(at)
      row.used += length
      row.items.append(item)
      bisect.insort(self._by_room, (room - length, k, serial, row))
      return []
    k = self.narrowest(length)
    emitted = []
    if self._open_count[k] >= self.pool * self.batch_sizes[k]:
      fullest = sorted(self.open_rows(k), key=lambda r: -r.used)[:self.batch_sizes[k]]
      leaving = {id(r) for r in fullest}
      emitted.append((k, fullest))
      self._by_room = [entry for entry in self._by_room if id(entry[3]) not in leaving]
      self._open_count[k] -= len(fullest)
    self._open_count[k] += 1
    row = Row(length, [item])
    bisect.insort(self._by_room, (self.widths[k] - length, k, self._serial, row))
    self._serial += 1
    return emitted

  def flush(self) -> list[tuple[int, list[Row]]]:
    units = sorted((row for k in reversed(range(len(self.widths))) for row in self.open_rows(k)), key=lambda r: -r.used)
    self._by_room, self._open_count = [], [0] * len(self.widths)
    rows: list[list[Row]] = [[] for _ in self.widths]
    placed = [False] * len(units)
    for k in reversed(range(len(self.widths))):
      for i, unit in enumerate(units):  # the rows that need W_k: into a row of width >= W_k
        if not placed[i] and self.narrowest(unit.used) == k:
          target = self._best_fit(rows, unit.used, k)
          if target is None:
            rows[k].append(Row(unit.used, list(unit.items)))
          else:
            target.add(unit.used, unit.items)
          placed[i] = True
      free = -len(rows[k]) % self.batch_sizes[k]  # fill rows of W_k's last batch: narrower rows may take them
      for i, unit in enumerate(units):
        if placed[i]:
          continue
        target = self._best_fit(rows, unit.used, k)
        if target is not None:
          target.add(unit.used, unit.items)
          placed[i] = True
        elif free and rows[k]:
          rows[k].append(Row(unit.used, list(unit.items)))
          placed[i], free = True, free - 1
    out = []
    for k, width_rows in enumerate(rows):
      width_rows = sorted(width_rows, key=lambda r: -r.used)
      out += [(k, width_rows[s:s + self.batch_sizes[k]]) for s in range(0, len(width_rows), self.batch_sizes[k])]
    return out

  def _best_fit(self, rows: list[list[Row]], length: int, k: int) -> Row | None:
    """Of `rows` (per width), the row of width >= W_k that `length` leaves the least room in, or None."""
    best, best_room = None, None
    for j in range(k, len(self.widths)):
      for row in rows[j]:
        room = self.widths[j] - row.used - length
        if room >= 0 and (best_room is None or room < best_room):
          best, best_room = row, room
    return best

  def empty(self) -> bool:
    return not self._by_room


def packed_batches_per_shape(lengths: Sequence[int], widths: Sequence[int],
                             batch_size_for: Callable[[int], int]) -> dict[tuple[int, int], int]:
  """Batches per (B_k, W_k) that bucketed packing emits for examples of `lengths`, in that order:
  the batches `WidthPacker` completes, then its flush at the epoch's end."""
  widths = sorted(int(w) for w in widths)
  sizes = [batch_size_for(w) for w in widths]
  packer = WidthPacker(widths, sizes)
  counts = [0] * len(widths)
  for length in np.asarray(lengths).tolist():
    for k, _ in packer.add(length, None):
      counts[k] += 1
  for k, _ in packer.flush():
    counts[k] += 1
  return {(b, w): n for b, w, n in zip(sizes, widths, counts) if n}


def packed_batch(rows: Sequence[Sequence[dict]], *, batch_size: int, width: int, pad_token_id: int) -> dict:
  """`rows[i]`'s examples back to back in row i of a (batch_size, width) batch: `input_ids`,
  `attention_mask`, `labels`, `segment_ids` (1, 2, ... per example in a row, 0 on padding) and
  `positions` (restarting at 0 in every segment), int32. Each segment's first label is -100 (nothing
  is predicted across a boundary); rows past len(rows) are fill rows. Raises ValueError when a row's
  examples are wider than `width` or there are more rows than `batch_size`."""
  if len(rows) > batch_size:
    raise ValueError(f"{len(rows)} rows do not fit in a batch of {batch_size}")
  input_ids = np.full((batch_size, width), pad_token_id, dtype=np.int32)
  labels = np.full((batch_size, width), IGNORE_INDEX, dtype=np.int32)
  segment_ids = np.zeros((batch_size, width), dtype=np.int32)
  positions = np.zeros((batch_size, width), dtype=np.int32)
  for r, examples in enumerate(rows):
    start = 0
    for segment, example in enumerate(examples, start=1):
      ids = np.asarray(example["input_ids"])
      if start + len(ids) > width:
        raise ValueError(f"row {r}'s examples ({sum(len(e['input_ids']) for e in examples)} tokens) exceed width {width}")
      at = slice(start, start + len(ids))
      input_ids[r, at], labels[r, at] = ids, example.get("labels", ids)
      segment_ids[r, at], positions[r, at] = segment, np.arange(len(ids))
      labels[r, start] = IGNORE_INDEX
      start += len(ids)
  return {"input_ids": input_ids, "attention_mask": (segment_ids > 0).astype(np.int32), "labels": labels,
          "segment_ids": segment_ids, "positions": positions}
