"""`PipelineStats`: the counters the batchers (bucketing.py, packing.py) update as the pipeline
(pipeline.py) emits batches."""

from __future__ import annotations

import dataclasses

from jaxsft.labels import IGNORE_INDEX


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

  def count_example(self, element: dict, max_length: int) -> None:
    """Counts one element of the tokenized stream: an example, or the marker of a dropped one."""
    self.examples += 1
    self.truncated += element["full_length"] > max_length
    if "input_ids" not in element:
      epoch = int(element["epoch"])
      self.dropped += 1
      self.dropped_per_epoch[epoch] = self.dropped_per_epoch.get(epoch, 0) + 1

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
