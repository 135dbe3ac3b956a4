"""Choosing bucket boundaries: the exact dynamic program over the token lengths, minimizing the
padded tokens of a bucket plan or, under a `StepCost`, its predicted seconds. Pure numpy (no jax):
`batches.choose_shapes` chooses the pipeline's buckets with it where it is given none."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jaxsft.collation.cost import StepCost


def choose_buckets(lengths: Sequence[int], num_buckets: int, *, multiple_of: int = 8,
                   max_length: int | None = None, batch_size: int | Callable[[int], int] | None = None,
                   cost: StepCost | None = None, epochs: float = 1.0, price_compiles: bool = False) -> list[int]:
  """Bucket boundaries minimizing the padded tokens, or the predicted seconds, of a bucket plan.

  With lengths rounded up to `multiple_of` (clipped to `max_length`) taking the distinct values
  `v_1 < ... < v_d` with counts `c_j` (prefix sums `C_b = sum_{j<=b} c_j`), a bucket whose
  boundary is `v_b` holds `n = C_b - C_a` examples `v_{a+1..b}`. Its cost is

    padding only (no `batch_size`):  w(a, b) = v_b · n
    with batches of B = batch_size(v_b) rows, fill rows priced, a step costing s(B, T):
      w(a, b) = epochs · ceil(n / B) · s(B, v_b)  [+ compile_seconds(B, v_b) with `price_compiles`]

  `s` is `cost.step_seconds` (default: B·T, so the plan's padded tokens with fill rows counted).
  The largest boundary is always `v_d` (the longest example, which is `max_length` once examples
  are truncated to it). The cost is a sum over buckets, so dynamic programming is exact:

    `D[k][b] = min(D[k-1][b], min_{a<b} D[k-1][a] + w(a, b))`

  over at most `num_buckets` buckets: O(K d^2) with d <= max_length / multiple_of. With compiles
  priced, a larger `num_buckets` only adds candidates: the DP picks how many buckets pay off.

  Returns:
    Sorted boundaries (at most `num_buckets`, fewer when there are fewer distinct values or when
    more buckets would not lower the cost).
  """
  if num_buckets < 1:
    raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
  lengths = np.asarray(lengths, dtype=np.int64)
  if lengths.size == 0:
    raise ValueError("choose_buckets needs at least one length")
  m = max(int(multiple_of or 1), 1)
  rounded_all = -(-lengths // m) * m
  if max_length is not None:
    rounded_all = np.minimum(rounded_all, max_length)
  values, counts = np.unique(rounded_all, return_counts=True)
  if batch_size is None and len(values) <= num_buckets:
    return [int(v) for v in values]
  return [int(values[b]) for b in _segment_dp(_bucket_costs(values, counts, batch_size, cost, epochs, price_compiles),
                                              num_buckets)]


def _bucket_costs(values: np.ndarray, counts: np.ndarray, batch_size, cost: StepCost | None, epochs: float,
                  price_compiles: bool) -> np.ndarray:
  """w[p, q]: the cost of one bucket holding values p..q-1 (0-based; p < q, else inf)."""
  d = len(values)
  prefix = np.concatenate([[0], np.cumsum(counts)])  # prefix[q] = examples among values 0..q-1
  n = (prefix[None, :] - prefix[:, None]).astype(np.float64)  # n[p, q]
  width = np.concatenate([[0], values]).astype(np.float64)[None, :]  # the bucket ending at q is v_{q-1}
  if batch_size is None:
    w = width * n
  else:
    size_of = batch_size if callable(batch_size) else (lambda _t, b=int(batch_size): b)
    rows = np.array([1] + [size_of(int(v)) for v in values], dtype=np.float64)[None, :]
    cost = cost if cost is not None else StepCost(a=0.0, b=1.0, c=0.0)
    w = epochs * np.ceil(n / rows) * cost.step_seconds(rows, width)
    if price_compiles:
      w = w + cost.compile_seconds(rows, width)
  return np.where(np.triu(np.ones((d + 1, d + 1), dtype=bool), k=1), w, np.inf)


def _segment_dp(w: np.ndarray, num_buckets: int) -> list[int]:
  """Indices (into the values) of the bucket ends of the cheapest split of values 0..d-1 into at
  most `num_buckets` consecutive buckets, bucket p..q-1 costing w[p, q]; ties keep fewer buckets."""
  d = w.shape[0] - 1
  # cost[k][q]: least cost of covering values 0..q-1 with at most k+1 buckets; prev[k][q]: where
  # the last of them starts (-1: this layer did not help).
  cost = [w[0].copy()]
  prev = [np.full(d + 1, -1)]
  for _ in range(1, num_buckets):
    cand = cost[-1][:, None] + w
    arg = np.argmin(cand, axis=0)
    new = cand[arg, np.arange(d + 1)]
    better = new < cost[-1]
    prev.append(np.where(better, arg, -1))
    cost.append(np.where(better, new, cost[-1]))
  ends, k, q = [], num_buckets - 1, d
  while True:
    while k > 0 and prev[k][q] < 0:  # at most k buckets did as well as at most k+1
      k -= 1
    ends.append(q - 1)
    if k == 0:
      break
    k, q = k - 1, int(prev[k][q])
  return sorted(ends)
