"""Collation plans from the cost model: each mode's batches per shape from the token lengths, its
predicted seconds (`cost.plan_seconds`), the widths of bucketed packing, and `batching: auto`.

Batches per shape of one epoch, from the lengths alone (the pipeline emits exactly these; packing
counts in the order the lengths are given, which for a shuffled epoch is its order):

    static            ceil(N / B) batches of (B, max_length)
    dynamic           batches of B consecutive examples, each as wide as its longest (rounded up);
                      the widths of these batches are what a run compiles (later epochs' own
                      orders may add a few)
    bucketed          ceil(n_k / B_k) batches of (B_k, T_k) per bucket
    packed            grain's first-fit into B rows of max_length, emitted together (`first_fit_batches`)
    bucketed_packed   rows of widths W_k, B_k rows a batch, as `rows.WidthPacker` fills them

`choose_collation` predicts every candidate (each mode; bucketed with the DP's boundaries for
every K up to `max_buckets` and with compiles priced, bucketed packing with 1 to 4 widths) and
returns them cheapest first: the first is what `batching: auto` runs.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Callable, Sequence

import numpy as np

from jaxsft.collation.buckets import choose_buckets
from jaxsft.collation.cost import PlanSeconds, StepCost, plan_seconds
from jaxsft.data.collate import batch_widths, bucket_index, round_up
from jaxsft.data.rows import packed_batches_per_shape  # what the packer makes, counted

MAX_PACKING_WIDTHS = 4
MAX_EXTRA_WASTE_POINTS = 2.0
"""How many points of padding bucketed packing's widths may add to packing's (`choose_packing_widths`)."""


def first_fit_batches(lengths: Sequence[int], width: int, batch_size: int) -> int:
  """Batches of `batch_size` rows of `width` that grain's `FirstFitPackIterDataset` (num_packing_bins
  = batch_size, as `packing.packed_batches` runs it) makes of one epoch of `lengths`, in that order:
  each example goes into the first of the B rows with room; one that fits in none sends all B rows
  out as a batch and starts the next B; the rows left at the end are one more batch."""
  batches, rows = 0, []
  for length in np.asarray(lengths).tolist():
    for i, used in enumerate(rows):
      if used + length <= width:
        rows[i] += length
        break
    else:
      if len(rows) == batch_size:
        batches, rows = batches + 1, []
      rows.append(length)
  return batches + (1 if rows else 0)


def padding_waste(lengths: Sequence[int], batches_per_shape: dict[tuple[int, int], int]) -> float:
  """Points of padding: 100·(1 - Σ lengths / Σ_s n_s·B_s·T_s), fill rows counted as padding."""
  padded = sum(b * t * n for (b, t), n in batches_per_shape.items())
  return 100.0 * (1.0 - float(np.sum(lengths)) / padded) if padded else 0.0


def choose_packing_widths(lengths: Sequence[int], num_widths: int, *, batch_size_for: Callable[[int], int],
                          cost: StepCost, multiple_of: int = 8, max_length: int | None = None,
                          epochs: float = 1.0, price_compiles: bool = False, sample: int = 50_000,
                          max_extra_waste: float = MAX_EXTRA_WASTE_POINTS) -> list[int]:
  """The widths (at most `num_widths`, the widest = the longest example) whose bucketed packing of
  `lengths` the cost model predicts cheapest, of those that pad at most `max_extra_waste` points
  more than the same packer does with max_length (the longest example without it) as its one width.

  Candidates for the narrower widths: the lengths' quartiles and 90th percentile, and half, a
  quarter and an eighth of the widest, rounded up to `multiple_of`; every subset of at most
  num_widths - 1 of them is simulated (`packed_batches_per_shape`) and priced (compiles too
  with `price_compiles`); ties keep fewer widths. Where no subset keeps to the bound, the cheapest
  of all. Past `sample` lengths the subsets are simulated on a seeded `sample` of them, in their
  order, and their steps scaled to all.

  Why the bound: narrow widths win on the fitted step cost, which is a prediction, while the
  padding they add is certain, and it costs on any machine. Plans a few tenths of a percent apart
  in predicted seconds can differ by points of padding (many rows that hold one typical example
  and a half, say), and the bound keeps the plan near packing's density.
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
  if len(lengths) > sample:  # the same per-shape shares at a fraction of the simulation
    epochs *= len(lengths) / sample
    lengths = lengths[np.sort(np.random.default_rng(0).choice(len(lengths), sample, replace=False))]
  bound = padding_waste(lengths, packed_batches_per_shape(lengths, [max_length or widest], batch_size_for))
  bound += max_extra_waste
  best, best_key = [widest], None
  for k in range(min(num_widths, len(grid) + 1)):
    for narrower in itertools.combinations(grid, k):
      widths = list(narrower) + [widest]
      per_shape = packed_batches_per_shape(lengths, widths, batch_size_for)
      seconds = plan_seconds(cost, per_shape, list(per_shape) if price_compiles else [], epochs=epochs).total
      key = (padding_waste(lengths, per_shape) > bound, seconds)  # within the bound first, then the cheapest
      if best_key is None or key < best_key:
        best, best_key = widths, key
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


def batches_per_shape(batching: str, lengths: Sequence[int], *, max_length: int, batch_size_for: Callable[[int], int],
                      bucket_lengths: Sequence[int] | None = None,
                      pad_to_multiple_of: int = 8) -> tuple[dict[tuple[int, int], int], list[tuple[int, int]]]:
  """(batches per (B, T) of one epoch, shapes compiled) of a mode over kept `lengths` in epoch order
  (see the module docstring); `bucket_lengths` are the buckets or widths of the bucketed modes."""
  lengths = np.minimum(np.asarray(lengths, dtype=np.int64), max_length)
  widest = (batch_size_for(max_length), max_length)
  if batching == "static":
    return {widest: -(-len(lengths) // widest[0])}, [widest]
  if batching == "packed":
    return {widest: first_fit_batches(lengths, max_length, widest[0])}, [widest]
  if batching == "bucketed_packed":
    per_shape = packed_batches_per_shape(lengths, bucket_lengths, batch_size_for)
    return per_shape, sorted((batch_size_for(t), t) for t in bucket_lengths)
  if batching == "bucketed":
    index = np.atleast_1d(bucket_index(lengths, sorted(bucket_lengths)))
    counts = np.bincount(index, minlength=len(bucket_lengths))
    shapes = [(batch_size_for(t), int(t)) for t in sorted(bucket_lengths)]
    return {s: -(-int(n) // s[0]) for s, n in zip(shapes, counts) if n}, shapes
  if batching == "dynamic":
    size = widest[0]
    per_shape = dict(collections.Counter((size, int(w)) for w in batch_widths(lengths, size, pad_to_multiple_of,
                                                                               max_length)))
    return per_shape, sorted(per_shape)  # a run compiles the widths of the batches it reads
  raise ValueError(f"no cost model for batching {batching!r}")


def choose_collation(lengths: Sequence[int], *, cost: StepCost, max_length: int, batch_size_for: Callable[[int], int],
                     pad_to_multiple_of: int = 8, epochs: float = 1.0, max_buckets: int = 16,
                     modes: Sequence[str] = ("static", "dynamic", "bucketed", "packed", "bucketed_packed"),
                     fixed_bucket_counts: Sequence[int] = (2, 4, 8, 16), trained_tokens: int = 0) -> list[Candidate]:
  """Every candidate plan of `modes` priced by `cost` over `epochs` epochs (`trained_tokens` a
  epoch: the same for all), cheapest first.

  Bucketed: "bucketed auto" (the DP with fill rows, step cost and compiles priced, K <= max_buckets)
  and the DP's boundaries at each of `fixed_bucket_counts` (with steps priced, not compiles, as
  `num_buckets: K` runs them); bucketed packing: the widths `choose_packing_widths` picks
  (compiles priced, at most `MAX_PACKING_WIDTHS`).
  """
  lengths = np.minimum(np.asarray(lengths, dtype=np.int64), max_length)
  common = dict(multiple_of=pad_to_multiple_of, max_length=max_length)
  plans: list[tuple[str, str, list[int] | None, int | None]] = []  # (name, batching, buckets, num_buckets)
  for mode in modes:
    if mode == "bucketed":
      buckets = choose_buckets(lengths, max_buckets, batch_size=batch_size_for, cost=cost, epochs=epochs,
                               price_compiles=True, **common)
      plans.append(("bucketed auto", "bucketed", buckets, len(buckets)))
      for k in fixed_bucket_counts:
        plans.append((f"bucketed K={k}", "bucketed",
                      choose_buckets(lengths, k, batch_size=batch_size_for, cost=cost, epochs=epochs, **common), k))
    elif mode == "bucketed_packed":
      widths = choose_packing_widths(lengths, MAX_PACKING_WIDTHS, batch_size_for=batch_size_for, cost=cost,
                                     epochs=epochs, price_compiles=True, **common)
      plans.append(("bucketed_packed auto", "bucketed_packed", widths, len(widths)))
    else:
      plans.append((mode, mode, None, None))
  out = []
  for name, batching, buckets, num_buckets in plans:
    per_shape, shapes = batches_per_shape(batching, lengths, max_length=max_length, batch_size_for=batch_size_for,
                                          bucket_lengths=buckets, pad_to_multiple_of=pad_to_multiple_of)
    arguments = {"batching": batching, "bucket_lengths": buckets}
    if num_buckets is not None:
      arguments["num_buckets"] = num_buckets
    out.append(Candidate(name, arguments, per_shape, tuple(shapes),
                         plan_seconds(cost, per_shape, shapes, epochs=epochs, trained_tokens=trained_tokens)))
  return sorted(out, key=lambda c: c.predicted.total)
