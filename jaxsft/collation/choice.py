"""The trainer's collation choice from its config: buckets, packing widths or (`batching: auto`) the
whole mode, from the token lengths and the cost model (`cost.py`), and the plan's predicted seconds.
Nothing here compiles or times: the seconds come in as a `StepCost` (the probes' fit, `probe.py`,
or the default).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import numpy as np

from jaxsft import config as config_lib
from jaxsft.collation import cost as cost_lib
from jaxsft.collation import plans as plans_lib
from jaxsft.collation.buckets import choose_buckets
from jaxsft.data.collate import round_up

log = logging.getLogger("jaxsft.collation")

CHOOSES_FROM_LENGTHS = ("bucketed", "bucketed_packed", "auto")
"""Modes whose shapes are chosen from the token lengths (without explicit `bucket_lengths`)."""
MAX_AUTO_BUCKETS = 16
"""`num_buckets: auto` considers up to this many buckets."""
TIMED_SHAPES = 6
"""Warm-up times one call of at most this many compiled shapes (spread over the widths) to fit the cost."""


@dataclasses.dataclass(frozen=True)
class Choice:
  """What was chosen (`name`, make_batches' `batching` arguments), under which `cost`, for how many
  `epochs`, and the priced candidates (cheapest first) when there was a choice of modes."""

  name: str
  batching: dict
  cost: cost_lib.StepCost
  epochs: float
  candidates: list = dataclasses.field(default_factory=list)


def batch_size_rule(d: config_lib.DataConfig, multiple: int) -> Callable[[int], int]:
  """B(T): `batch_size`, or `tokens_per_batch // T` rounded down to a multiple of `multiple` (the
  pipeline's rule)."""
  multiple = max(multiple, 1)
  if d.tokens_per_batch is None:
    return lambda width: d.batch_size
  return lambda width: max((d.tokens_per_batch // width) // multiple * multiple, multiple)


def planned_epochs(cfg: config_lib.TrainConfig, num_train: int, batch_size: int) -> float:
  """Epochs the run will read: `epochs`, or with `max_steps` its batches over ceil(N / B) a epoch
  (an estimate before the plan: packing and buckets change the batches per epoch)."""
  return cost_lib.epochs_planned(math.ceil(num_train / max(batch_size, 1)), epochs=cfg.epochs,
                                 max_steps=cfg.max_steps, grad_accum=cfg.optim.grad_accum)


def choose(cfg: config_lib.TrainConfig, lengths: np.ndarray, *, num_train: int, max_length: int,
           batch_size_for: Callable[[int], int], cost: cost_lib.StepCost | None = None) -> Choice:
  """The batching for `cfg.data` over `lengths` (train and held-out; `num_train` of them train).

  bucketed: the DP's boundaries, fill rows counted (padded tokens with a number of buckets; the
  predicted seconds with compiles priced under `num_buckets: auto`); bucketed_packed: the widths
  the cost model prices cheapest (compiles priced under auto); auto: `choose_collation`'s cheapest.
  Without `cost`, the default cost (`cost.DEFAULT_COST`) prices what needs seconds.
  """
  d = cfg.data
  cost = cost or cost_lib.DEFAULT_COST
  epochs = planned_epochs(cfg, num_train, batch_size_for(max_length))
  auto_count = d.num_buckets == "auto"
  count = MAX_AUTO_BUCKETS if auto_count else int(d.num_buckets)
  common = dict(multiple_of=d.pad_to_multiple_of, max_length=max_length)
  if d.batching == "auto":
    candidates = plans_lib.choose_collation(lengths, cost=cost, max_length=max_length, batch_size_for=batch_size_for,
                                             pad_to_multiple_of=d.pad_to_multiple_of, epochs=epochs,
                                             max_buckets=count)
    return Choice(candidates[0].name, candidates[0].batching, cost, epochs, candidates)
  if d.batching == "bucketed":
    if auto_count:
      buckets = choose_buckets(lengths, count, batch_size=batch_size_for, cost=cost, epochs=epochs, price_compiles=True,
                               **common)
    else:
      buckets = choose_buckets(lengths, count, batch_size=batch_size_for, **common)
  else:
    buckets = plans_lib.choose_packing_widths(lengths, min(count, plans_lib.MAX_PACKING_WIDTHS) if auto_count else count,
                                               batch_size_for=batch_size_for, cost=cost, epochs=epochs,
                                               price_compiles=auto_count, **common)
  return Choice(f"{d.batching} K={len(buckets)}", {"batching": d.batching, "bucket_lengths": buckets,
                                                   "num_buckets": len(buckets)}, cost, epochs)


ORDER_FREE = ("static", "bucketed")
"""Modes whose batches per shape do not depend on the order the examples come in."""


def priced_lengths(batching: str, tokenized, *, seed: int) -> np.ndarray:
  """The training lengths a plan of `batching` is priced over: in the first epoch's order
  (`data.epoch_lengths`) where packing or dynamic padding make the batches depend on it (auto
  prices those too), in record order otherwise (the same counts without the epoch's permutation,
  which costs seconds per million records)."""
  if batching in ORDER_FREE:
    return tokenized.lengths
  from jaxsft.data import epoch_lengths

  return epoch_lengths(tokenized, seed=seed)


def probe_widths(max_length: int, multiple_of: int) -> list[int]:
  """Widths `auto` times before it chooses: a quarter, half and all of max_length (three distinct
  widths fit a, b and c)."""
  return sorted({min(round_up(max(max_length // f, 1), multiple_of), max_length) for f in (4, 2, 1)})


def timed_shapes(shapes: list[tuple[int, int]], limit: int = TIMED_SHAPES) -> list[tuple[int, int]]:
  """At most `limit` of `shapes`, spread evenly over them in width order (the narrowest and widest kept)."""
  shapes = sorted(shapes, key=lambda s: (s[1], s[0]))
  if len(shapes) <= limit:
    return shapes
  return [shapes[i] for i in sorted({round(i * (len(shapes) - 1) / (limit - 1)) for i in range(limit)})]


def trained_tokens(tokenized, sample: int = 20_000) -> int:
  """Labels trained per epoch (each example's first label never is: nothing predicts it); over a
  seeded sample of `sample` examples, scaled, when there are more."""
  kept = [i for i in range(len(tokenized)) if int(tokenized.full_lengths[i]) > 0]
  if len(kept) > sample:
    picked = np.random.default_rng(0).choice(kept, sample, replace=False).tolist()
  else:
    picked = kept
  counts = [int((np.asarray(e["labels"][1:]) != -100).sum()) for e in (tokenized.examples[i] for i in picked)
            if e is not None]
  return round(sum(counts) * len(kept) / max(len(picked), 1))


def predicted(choice_cost: cost_lib.StepCost, batching: dict, lengths: np.ndarray, shapes: list[tuple[int, int]], *,
              batch_size_for: Callable[[int], int], epochs: float, trained: int = 0) -> cost_lib.PlanSeconds:
  """The plan's predicted seconds under `choice_cost`: its batches per shape over the training
  lengths (`priced_lengths`) and `trained` trained labels, `epochs` times, and a compile per shape
  in `shapes`."""
  per_shape, _ = plans_lib.batches_per_shape(batching["batching"], lengths, max_length=batching["max_length"],
                                              batch_size_for=batch_size_for, bucket_lengths=batching["bucket_lengths"],
                                              pad_to_multiple_of=batching["pad_to_multiple_of"])
  return cost_lib.plan_seconds(choice_cost, per_shape, shapes, epochs=epochs, trained_tokens=trained)


def log_choice(choice: Choice) -> None:
  """One line for the choice and, for auto, one per runner-up with its predicted seconds."""
  if not choice.candidates:
    # The cost the plan was chosen with; the run's prediction, logged next, may use a measured one.
    log.info("collation: %s %s (chosen with cost %s)", choice.name, choice.batching.get("bucket_lengths") or "",
             choice.cost.source)
    return
  best = choice.candidates[0]
  # Every candidate is priced over the same data, `choice.epochs` (with max_steps: that many batches
  # of the widest shape); the run's own prediction, logged next, is over the batches it will run.
  log.info("collation auto: %s %s, predicted %.1fs over %.3g epochs (steps %.1fs + compiles %.1fs; cost %s)",
           best.name, best.batching.get("bucket_lengths") or "", best.predicted.total, choice.epochs,
           best.predicted.steps, best.predicted.compiles, choice.cost.source)
  for other in choice.candidates[1:6]:
    log.info("  runner-up %s: predicted %.1fs (steps %.1fs + compiles %.1fs)", other.name, other.predicted.total,
             other.predicted.steps, other.predicted.compiles)
