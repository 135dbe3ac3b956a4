"""A comparison of the batching modes (padding, shapes, predicted seconds under the cost model),
from one epoch of the real pipeline each: what `python -m jaxsft.data stats` prints."""

from __future__ import annotations

import collections
from typing import Sequence

from jaxsft.collation.batches import batch_shapes, make_batches
from jaxsft.collation.cost import PlanSeconds, StepCost, plan_seconds
from jaxsft.config_checks import BATCHING
from jaxsft.data.examples import TokenizedRecords
from jaxsft.data.pipeline_stats import PipelineStats
from jaxsft.data.tokenize import tokenize_records


def compare_batching(records: Sequence[dict], tokenizer, *, max_length: int = 1024, num_buckets: int = 8,
                     batch_size: int = 8, pad_to_multiple_of: int = 8, seed: int = 0,
                     train_on: str = "all_assistant", tokenized: TokenizedRecords | None = None) -> dict[str, dict]:
  """Runs one epoch of `make_batches` per batching mode and reports what it emitted.

  The records are tokenized once (or `tokenized` is used) for every mode.

  Returns, per mode: `padded` (B*T summed over batches, fill rows included), `real` (tokens with
  attention_mask 1), `waste_frac = 1 - real / padded`, `shapes` (distinct (B, T) emitted),
  `listed_shapes` (`batch_shapes`), `batches`, `per_shape` (batches of each (B, T)), `listed`
  (the shapes a trainer compiles), `trained` (label tokens), and for the bucketed modes the chosen
  `buckets`.
  """
  if tokenized is None:
    tokenized = tokenize_records(tokenizer, records, max_length=max_length, train_on=train_on)
  out = {}
  for mode in BATCHING:
    stats = PipelineStats()
    config = dict(max_length=max_length, batching=mode, num_buckets=num_buckets, batch_size=batch_size,
                  pad_to_multiple_of=pad_to_multiple_of, train_on=train_on, tokenized=tokenized)
    per_shape = collections.Counter()
    for batch in make_batches(records, tokenizer, seed=seed, num_epochs=1, stats=stats, **config):
      per_shape[batch["input_ids"].shape] += 1
    # What a one-epoch run compiles: dynamic's emitted widths (`dynamic_batch_shapes`), else every listed shape.
    listed = sorted(per_shape) if mode == "dynamic" else batch_shapes(records, tokenizer, **config)
    out[mode] = {"padded": stats.padded_tokens, "real": stats.real_tokens, "waste_frac": stats.waste_frac,
                 "shapes": len(per_shape), "listed_shapes": len(listed), "batches": stats.batches,
                 "fill_rows": stats.fill_rows, "dropped": stats.dropped, "truncated": stats.truncated,
                 "per_shape": dict(per_shape), "listed": listed, "trained": stats.label_tokens}
    if mode in ("bucketed", "bucketed_packed"):
      out[mode]["buckets"] = [t for _, t in listed]
  return out


def predict_seconds(result: dict[str, dict], cost: StepCost, *, epochs: float = 1.0) -> dict[str, PlanSeconds]:
  """Per mode of `compare_batching`'s result: its emitted batches' steps, `epochs` times, and a
  compile of every listed shape, priced by `cost`."""
  return {mode: plan_seconds(cost, r["per_shape"], r["listed"], epochs=epochs, trained_tokens=r["trained"])
          for mode, r in result.items()}


def format_comparison(result: dict[str, dict], predicted: dict[str, PlanSeconds] | None = None) -> str:
  """The table of modes; with `predicted`, the end-to-end seconds (steps + compiles) of each."""
  more = f" {'steps s':>9} {'compile s':>9} {'total s':>9}" if predicted else ""
  lines = [f"{'mode':<15} {'padded tokens':>14} {'real tokens':>12} {'waste %':>8} {'shapes':>7} {'batches':>8}{more}"]
  for mode, r in result.items():
    more = ""
    if predicted:
      p = predicted[mode]
      more = f" {p.steps:>9.1f} {p.compiles:>9.1f} {p.total:>9.1f}"
    lines.append(f"{mode:<15} {r['padded']:>14,} {r['real']:>12,} {100 * r['waste_frac']:>8.1f} "
                 f"{r['shapes']:>7} {r['batches']:>8}{more}")
  for mode in ("bucketed", "bucketed_packed"):
    if mode in result:
      lines.append(f"{'bucket boundaries' if mode == 'bucketed' else 'packing widths'}: {result[mode]['buckets']}")
  return "\n".join(lines)
