"""Collation plans from the cost model: each mode's batches per shape from the token lengths, its
predicted seconds (`cost.plan_seconds`), the widths of bucketed packing, and `batching: auto`.

Batches per shape of one epoch, from the lengths alone (the pipeline emits exactly these; packing
counts in the order the lengths are given, which for a shuffled epoch is its order):

    static            ceil(N / B) batches of (B, max_length)
    dynamic           batches of B consecutive examples, each as wide as its longest (rounded up)
    bucketed          ceil(n_k / B_k) batches of (B_k, T_k) per bucket
    packed            first-fit rows of max_length, B rows a batch
    bucketed_packed   per width W_k, first-fit rows of W_k holding the examples whose narrowest
                      fitting width is W_k, B_k rows a batch

`choose_collation` predicts every candidate (each mode; bucketed with the DP's boundaries for
every K up to `max_buckets` and with compiles priced, bucketed packing with 1 to 4 widths) and
returns them cheapest first: the first is what `batching: auto` runs.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Sequence

import numpy as np

from jaxsft.data.collate import bucket_index, choose_buckets, round_up
from jaxsft.data.cost import PlanSeconds, StepCost, plan_seconds
from jaxsft.data.packing import FirstFitRows

MAX_PACKING_WIDTHS = 4


def packed_batches_per_shape(lengths: Sequence[int], widths: Sequence[int],
                             batch_size_for: Callable[[int], int]) -> dict[tuple[int, int], int]:
  """Batches per (B_k, W_k) that bucketed packing emits for examples of `lengths`, in that order:
  each example goes to the narrowest width >= its length; a width's batch is B_k rows filled
  first-fit, emitted when an example fits in none of them (then the leftovers, at the end)."""
  widths = sorted(int(w) for w in widths)
  sizes = [batch_size_for(w) for w in widths]
  rows = [FirstFitRows(b, w) for b, w in zip(sizes, widths)]
  counts, used = [0] * len(widths), [False] * len(widths)
  for length, k in zip(np.asarray(lengths).tolist(), np.atleast_1d(bucket_index(np.asarray(lengths), widths)).tolist()):
    if rows[k].place(length) is None:
      counts[k] += 1
      rows[k] = FirstFitRows(sizes[k], widths[k])
      rows[k].place(length)
    used[k] = True
  return {(b, w): n + u for b, w, n, u in zip(sizes, widths, counts, used) if n + u}


def choose_packing_widths(lengths: Sequence[int], num_widths: int, *, batch_size_for: Callable[[int], int],
                          cost: StepCost, multiple_of: int = 8, max_length: int | None = None,
                          epochs: float = 1.0, price_compiles: bool = False) -> list[int]:
  """The widths (at most `num_widths`, the widest = the longest example) whose bucketed packing of
  `lengths` the cost model predicts cheapest.

  Candidates for the narrower widths: the lengths' quartiles and 90th percentile, and half, a
  quarter and an eighth of the widest, rounded up to `multiple_of`; every subset of at most
  num_widths - 1 of them is simulated (`packed_batches_per_shape`) and priced (compiles too
  with `price_compiles`); ties keep fewer widths.
  """
  lengths = np.asarray(lengths, dtype=np.int64)
  if max_length is not None:
    lengths = np.minimum(lengths, max_length)
  widest = round_up(int(lengths.max()), multiple_of)
  if max_length is not None:
    widest = min(widest, max_length)
  grid = {round_up(int(np.percentile(lengths, q)), multiple_of) for q in (25, 50, 75, 90)}
  grid |= {round_up(widest // f, multiple_of) for f in (2, 4, 8)}
  grid = sorted(w for w in grid if 0 < w < widest)
  best, best_seconds = [widest], None
  for k in range(min(num_widths, len(grid) + 1)):
    for narrower in itertools.combinations(grid, k):
      widths = list(narrower) + [widest]
      per_shape = packed_batches_per_shape(lengths, widths, batch_size_for)
      seconds = plan_seconds(cost, per_shape, list(per_shape) if price_compiles else [], epochs=epochs).total
      if best_seconds is None or seconds < best_seconds:
        best, best_seconds = widths, seconds
  return best


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A collation plan the cost model priced: make_batches' batching arguments, the batches per
  shape of one epoch, the shapes compiled, and the predicted seconds of the run."""

  name: str
  batching: dict
  batches_per_shape: dict
  shapes: tuple
  predicted: PlanSeconds

  def summary(self) -> dict:
    return {"name": self.name, "batching": self.batching, "shapes": [list(s) for s in self.shapes],
            "predicted_seconds": self.predicted.to_dict()}
