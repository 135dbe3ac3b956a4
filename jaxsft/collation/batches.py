"""The data pipeline's entry points (`jaxsft.data.make_batches`, `batch_shapes`, `count_batches`),
with the shapes chosen here where the caller gives none: bucketed batching without
`bucket_lengths` batches to `num_buckets` boundaries of the bucket DP (the fewest padded tokens,
fill rows of each bucket's last batch counted), bucketed packing to the `num_buckets` widths the
default cost prices cheapest. The data layer takes the chooser as an argument: it imports nothing
from here.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jaxsft.collation.buckets import choose_buckets
from jaxsft.collation.cost import DEFAULT_COST
from jaxsft.collation.plans import choose_packing_widths
from jaxsft.data import pipeline


def choose_shapes(lengths: np.ndarray, *, batching: str, num_buckets: int, multiple_of: int, max_length: int,
                  batch_size_for: Callable[[int], int]) -> list[int]:
  """The bucket boundaries ("bucketed") or packing widths ("bucketed_packed") for kept token
  `lengths` (cut to `max_length`): the pipeline's `ShapeChooser`."""
  if batching == "bucketed_packed":
    return choose_packing_widths(lengths, num_buckets, batch_size_for=batch_size_for, cost=DEFAULT_COST,
                                 multiple_of=multiple_of, max_length=max_length)
  return choose_buckets(lengths, num_buckets, multiple_of=multiple_of, max_length=max_length, batch_size=batch_size_for)


def make_batches(records: Sequence[dict], tokenizer, **kwargs):
  """`jaxsft.data.make_batches`, the buckets or widths chosen from the token lengths where
  `bucket_lengths` is None (every record tokenized once first unless `tokenized` is given)."""
  return pipeline.make_batches(records, tokenizer, choose_shapes=choose_shapes, **kwargs)


def batch_shapes(records: Sequence[dict] | None = None, tokenizer=None, **kwargs) -> list[tuple[int, int]]:
  """`jaxsft.data.batch_shapes`, the buckets or widths chosen as `make_batches` chooses them."""
  return pipeline.batch_shapes(records, tokenizer, choose_shapes=choose_shapes, **kwargs)


def count_batches(tokenized, **kwargs) -> int:
  """`jaxsft.data.count_batches`, the buckets or widths chosen as `make_batches` chooses them."""
  return pipeline.count_batches(tokenized, choose_shapes=choose_shapes, **kwargs)
