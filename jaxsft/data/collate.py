"""Padding tokenized examples into (B, T) batches, and the padding arithmetic of given buckets.

Pure numpy. A feature is `{"input_ids": int[L], "labels": int[L]}` (labels aligned with
input_ids, -100 on untrained tokens; the loss does the shift).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxsft.labels import IGNORE_INDEX


def round_up(n: int, multiple: int | None) -> int:
  """The smallest multiple of `multiple` that is >= n (n itself when multiple is None or 1)."""
  if not multiple or multiple <= 1:
    return int(n)
  return int(-(-n // multiple) * multiple)


def batch_widths(lengths: Sequence[int], batch_size: int, multiple_of: int | None, max_length: int) -> np.ndarray:
  """Dynamic padding's T of each batch of `batch_size` consecutive `lengths` (the last holds what
  is left): its longest, rounded up to a multiple of `multiple_of`, at most `max_length`."""
  lengths = np.asarray(lengths, dtype=np.int64)
  if len(lengths) == 0:
    return lengths
  m = max(multiple_of or 1, 1)
  longest = np.maximum.reduceat(lengths, np.arange(0, len(lengths), batch_size))
  return np.minimum(-(-longest // m) * m, max_length)


def target_length(max_len: int, *, bucket_lengths: Sequence[int] | None = None,
                  pad_to_multiple_of: int | None = None) -> int:
  """T for a batch whose longest feature has `max_len` tokens.

  The smallest bucket >= max_len when `bucket_lengths` is given, else max_len rounded up to
  `pad_to_multiple_of`.
  """
  if bucket_lengths is None:
    return round_up(max_len, pad_to_multiple_of)
  buckets = sorted(bucket_lengths)
  return int(buckets[bucket_index(max_len, buckets)])


def bucket_index(lengths, bucket_lengths: Sequence[int]):
  """Index of the smallest bucket >= each length (`bucket_lengths` sorted ascending).

  `lengths` is one int (returns an int) or an array (returns an int array). Raises ValueError
  when a length fits no bucket, naming the longest length and the largest bucket.
  """
  buckets = np.asarray(bucket_lengths)
  index = np.searchsorted(buckets, lengths, side="left")
  if np.any(index == len(buckets)):
    raise ValueError(f"an example of {int(np.max(lengths))} tokens fits no bucket (largest is {int(buckets[-1])})")
  return int(index) if np.ndim(index) == 0 else index


def collate(features: Sequence[dict], *, pad_token_id: int, bucket_lengths: Sequence[int] | None = None,
            pad_to_multiple_of: int | None = None, batch_size: int | None = None) -> dict[str, np.ndarray]:
  """Right-pads features into a batch of int32 `(B, T)` arrays.

  Returns `input_ids` (`pad_token_id` on padding), `attention_mask` (1 on real tokens, 0 on
  padding) and `labels` (-100 on padding). T is `target_length(max_i L_i, ...)`. With
  `batch_size` > len(features), the batch is filled with all-padding rows (attention_mask 0,
  labels -100) so every batch of a bucket has one shape. A feature without `labels` gets
  `labels = input_ids` (every token trained).
  """
  if not features:
    raise ValueError("collate needs at least one feature")
  n = len(features)
  rows = n if batch_size is None else batch_size
  if rows < n:
    raise ValueError(f"batch_size {batch_size} < number of features {n}")
  lengths = [len(f["input_ids"]) for f in features]
  width = target_length(max(lengths), bucket_lengths=bucket_lengths, pad_to_multiple_of=pad_to_multiple_of)
  input_ids = np.full((rows, width), pad_token_id, dtype=np.int32)
  labels = np.full((rows, width), IGNORE_INDEX, dtype=np.int32)
  attention_mask = np.zeros((rows, width), dtype=np.int32)
  for i, (f, length) in enumerate(zip(features, lengths)):
    ids = f["input_ids"]
    lab = f.get("labels", ids)
    if len(lab) != length:
      raise ValueError(f"feature {i}: labels has length {len(lab)}, input_ids {length}")
    input_ids[i, :length] = ids
    labels[i, :length] = lab
    attention_mask[i, :length] = 1
  return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ---------------------------------------------------------------------------------------------
# Padding arithmetic (choosing the buckets is `jaxsft.collation.buckets`).


@dataclasses.dataclass(frozen=True)
class PaddingCost:
  """Tokens of a batching plan: `real` (sum of lengths), `padded` (B*T summed over batches, the
  tokens the model computes on), `waste = padded - real`, `waste_frac = waste / padded`."""

  real: int
  padded: int
  num_shapes: int = 1

  @property
  def waste(self) -> int:
    return self.padded - self.real

  @property
  def waste_frac(self) -> float:
    return self.waste / self.padded if self.padded else 0.0


def padding_cost(lengths: Sequence[int], bucket_lengths: Sequence[int]) -> PaddingCost:
  """Cost of padding every example to its bucket (no batching effects):
  `padded = sum_i min{b in buckets : b >= l_i}`."""
  lengths = np.asarray(lengths, dtype=np.int64)
  buckets = np.sort(np.asarray(bucket_lengths, dtype=np.int64))
  idx = bucket_index(lengths, buckets)
  return PaddingCost(real=int(lengths.sum()), padded=int(buckets[idx].sum()),
                     num_shapes=int(np.unique(idx).size))
