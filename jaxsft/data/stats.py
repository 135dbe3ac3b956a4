"""Token length statistics of tokenized data: the summary and text histogram `python -m jaxsft.data stats`
prints above its comparison of the batching modes (`jaxsft.collation.compare`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxsft.data.examples import TokenizedRecords


def length_summary(tokenized: TokenizedRecords) -> dict:
  """Token lengths before truncation: count, percentiles, and how many truncation cuts or drops."""
  full, max_length = tokenized.full_lengths, tokenized.max_length
  return {"count": len(full), "min": int(full.min()), "p50": float(np.percentile(full, 50)),
          "p90": float(np.percentile(full, 90)), "p99": float(np.percentile(full, 99)), "max": int(full.max()),
          "mean": float(full.mean()), "truncated": int((full > max_length).sum()),
          "dropped": tokenized.num_dropped, "lengths": full}


def text_histogram(lengths: Sequence[int], *, max_length: int, bins: int = 16, width: int = 50) -> str:
  """A text histogram of token lengths in `bins` equal bins up to max_length (longer ones last);
  fewer, one token wide, where max_length is under `bins`."""
  lengths = np.asarray(lengths)
  edges = np.unique(np.linspace(0, max_length, bins + 1).astype(int))
  counts = [int(((lengths > lo) & (lengths <= hi)).sum()) for lo, hi in zip(edges[:-1], edges[1:])]
  labels = [f"{lo + 1:>6}-{hi:<6}" for lo, hi in zip(edges[:-1], edges[1:])]
  over = int((lengths > max_length).sum())
  if over:
    counts.append(over)
    labels.append(f">{max_length:<12}")
  top = max(counts) or 1
  return "\n".join(f"{label} {'#' * round(width * c / top):<{width}} {c}" for label, c in zip(labels, counts))
