"""`PipelineStats`: the counters the batchers (bucketing.py, packing.py) update as the pipeline
(pipeline.py) emits batches."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsft.labels import IGNORE_INDEX


@dataclasses.dataclass
class PipelineStats:
  """Counters the pipeline updates in place as batches are emitted (main process only).

  `examples` tokenized examples seen (all epochs), `truncated` longer than max_length (cut),
  `dropped` left with no trained token after truncation (not batched), `batches`, `rows`
  (including `fill_rows`, all-padding rows), `real_tokens` (attention_mask 1), `padded_tokens`
  (B*T summed), `label_tokens` (labels != -100). With several sources (`data.mix`), per source i:
  `source_examples[i]` (counted as `examples` is) and `source_trained_tokens[i]` (as `label_tokens`),
  so each list sums to its total. Batches restored by `set_state` replay are not counted again.
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
  source_examples: list = dataclasses.field(default_factory=list)  # lists: a checkpoint's JSON keeps them
  source_trained_tokens: list = dataclasses.field(default_factory=list)

  @property
  def waste_frac(self) -> float:
    return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

  def count_example(self, element: dict, max_length: int) -> None:
    """Counts one element of the tokenized stream: an example, or the marker of a dropped one."""
    self.examples += 1
    if "source" in element:
      _add(self.source_examples, int(element["source"]), 1)
    self.truncated += element["full_length"] > max_length
    if "input_ids" not in element:
      epoch = int(element["epoch"])
      self.dropped += 1
      self.dropped_per_epoch[epoch] = self.dropped_per_epoch.get(epoch, 0) + 1

  def count_batch(self, batch: dict, num_real_rows: int, row_sources: list | None = None) -> None:
    """`row_sources[r]`: the sources of row r's examples, in order (its segments 1, 2, ... when the
    batch is packed); None when the examples name no source."""
    if row_sources is not None:
      for source, tokens in trained_by_source(batch, row_sources).items():
        _add(self.source_trained_tokens, source, tokens)
    self.batches += 1
    self.rows += batch["input_ids"].shape[0]
    self.fill_rows += batch["input_ids"].shape[0] - num_real_rows
    self.real_tokens += int(batch["attention_mask"].sum())
    self.padded_tokens += batch["input_ids"].size
    self.label_tokens += int((batch["labels"] != IGNORE_INDEX).sum())

  def restore(self, counts: dict) -> None:
    """Sets the counters, in place, to `counts`: a `dataclasses.asdict` of them, as a checkpoint's
    JSON holds it (its per-epoch keys are strings there)."""
    for name, value in counts.items():
      if name == "dropped_per_epoch":
        value = {int(epoch): count for epoch, count in value.items()}
      setattr(self, name, value)

  @classmethod
  def of(cls, counts: dict) -> "PipelineStats":
    """The counters `counts` holds (as `restore` reads them)."""
    stats = cls()
    stats.restore(counts)
    return stats

  def source_counts(self, num_sources: int) -> list[dict]:
    """[{examples, trained_tokens}] per source, zeros for a source not read yet."""
    def at(counts, i):
      return int(counts[i]) if i < len(counts) else 0

    return [{"examples": at(self.source_examples, i), "trained_tokens": at(self.source_trained_tokens, i)}
            for i in range(num_sources)]

  def summary(self) -> str:
    return (f"{self.examples} examples ({self.truncated} truncated, {self.dropped} dropped: no trained "
            f"token left), {self.batches} batches, {self.fill_rows} fill rows, "
            f"{self.padded_tokens} padded tokens ({100 * self.waste_frac:.1f}% padding)")


def _add(counts: list, index: int, amount: int) -> None:
  counts.extend([0] * (index + 1 - len(counts)))
  counts[index] += amount


def trained_by_source(batch: dict, row_sources: list) -> dict[int, int]:
  """{source: trained tokens (labels != -100)} of a batch whose row r holds examples of
  `row_sources[r]`: a packed row (with `segment_ids`) one per segment, else one per row."""
  trained = batch["labels"] != IGNORE_INDEX
  segments = batch.get("segment_ids")
  out: dict[int, int] = {}
  for r, sources in enumerate(row_sources):
    if segments is None:
      counts = [int(trained[r].sum())]
    else:
      counts = np.bincount(segments[r][trained[r]], minlength=len(sources) + 1)[1:].tolist()
    for source, count in zip(sources, counts):
      out[int(source)] = out.get(int(source), 0) + int(count)
  return out
