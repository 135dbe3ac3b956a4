"""Several data sources mixed by weight (`data.mix`).

The sources' records are laid end to end in one index space: source i holds the global record
indices [starts[i], starts[i] + sizes[i]) (`MixedRecords`; their examples `ConcatExamples`), so
the pipeline's tokenization, token store views, batching and checkpointed position work on a mix
as on one source. `Mix.indices` is the Grain dataset of the global indices in mixed order: each
source shuffled on its own (a seed of its own, reseeded every pass as a single source is), the
sources interleaved by `grain.MapDataset.mix` in proportion to their weights. Every position is a
pure function of (seed, position), so a resumed run reads exactly the records an unbroken one does.

An epoch is Grain's mix length: it ends when the source with the fewest records per unit of
weight, min_i(n_i / w_i), has given each of its records once, at L = int(min_i n_i / w_i)
positions. Positions past L go on: every source continues where it stopped (the exhausted one
starts a new shuffled pass, the others keep reading their current pass), so over several epochs
the proportions stay the weights and a large source is not restarted from its first records.
Grain rounds the weights to integers with the smallest at 100, so proportions are exact to
within 1% of the smallest weight.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import grain
import numpy as np

from jaxsft.data.examples import ExampleSource, RecordsWithTokens, TokenizedRecords


def normalized(weights: Sequence[float]) -> tuple[float, ...]:
  """Weights scaled to sum to 1 (they are relative)."""
  total = float(sum(weights))
  return tuple(float(w) / total for w in weights)


def source_seed(seed: int, source: int) -> int:
  """Source `source`'s shuffle seed: independent of the others' (a seed + i would make source i's
  first pass the order of source 0's i-th pass when their sizes agree)."""
  return int(np.random.SeedSequence([seed, source]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class Mix:
  """How the sources are drawn: `sizes[i]` training records of source i, drawn with `weights[i]`
  (normalized on construction)."""

  sizes: tuple[int, ...]
  weights: tuple[float, ...]

  def __post_init__(self):
    if len(self.sizes) != len(self.weights) or not self.sizes:
      raise ValueError(f"a mix needs one weight per source, got sizes {self.sizes} and weights {self.weights}")
    if min(self.sizes) < 1:
      raise ValueError(f"every source of a mix needs a training record, got sizes {self.sizes}")
    object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))
    object.__setattr__(self, "weights", normalized(self.weights))

  @functools.cached_property
  def starts(self) -> np.ndarray:
    """int64: source i's first global record index."""
    return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

  @property
  def num_records(self) -> int:
    return int(sum(self.sizes))

  def indices(self, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """The global record indices of one epoch in mixed order (indexing past its length continues
    into the next epochs: see the module docstring)."""
    parts = []
    for i, (start, n) in enumerate(zip(self.starts.tolist(), self.sizes)):
      part = grain.MapDataset.range(start, start + n)
      parts.append(part.shuffle(seed=source_seed(seed, i)) if shuffle else part)
    return grain.MapDataset.mix(parts, list(self.weights))

  @functools.cached_property
  def epoch_size(self) -> int:
    """Positions in one epoch (L in the module docstring)."""
    return len(self.indices(0, shuffle=False))

  def source_of(self, record_index: int) -> int:
    """The source a global record index belongs to."""
    return int(np.searchsorted(self.starts, record_index, side="right")) - 1

  def epoch_order(self, seed: int, shuffle: bool = True, epoch: int = 0) -> np.ndarray:
    """int64: the global record indices epoch `epoch` reads, in order."""
    ds, n = self.indices(seed, shuffle), self.epoch_size
    return np.fromiter((ds[i] for i in range(epoch * n, (epoch + 1) * n)), dtype=np.int64, count=n)


class MixedRecords(Sequence):
  """The training records of several sources end to end (record k of source i at starts[i] + k);
  each source's records stay what they were (a list, a token store's lazy view)."""

  def __init__(self, parts: Sequence[Sequence[dict]]):
    self.parts = list(parts)
    self.sizes = tuple(len(p) for p in self.parts)
    self._ends = np.cumsum(self.sizes, dtype=np.int64)

  def __len__(self) -> int:
    return int(self._ends[-1]) if self.parts else 0

  def __getitem__(self, k: int) -> dict:
    k = int(k)
    if k < 0:
      k += len(self)
    if not 0 <= k < len(self):
      raise IndexError(f"record {k} of {len(self)}")
    i = int(np.searchsorted(self._ends, k, side="right"))
    return self.parts[i][k - int(self._ends[i] - self.sizes[i])]


class StoredMixedRecords(MixedRecords, RecordsWithTokens):
  """Mixed records whose every source carries its token store's tokenization."""

  @property
  def tokenized(self) -> TokenizedRecords:
    return concat_tokenized([p.tokenized for p in self.parts])


def mixed_records(parts: Sequence[Sequence[dict]]) -> MixedRecords:
  """`StoredMixedRecords` when every source comes from a token store, else `MixedRecords`."""
  if all(isinstance(p, RecordsWithTokens) for p in parts):
    return StoredMixedRecords(parts)
  return MixedRecords(parts)


class ConcatExamples(ExampleSource):
  """The examples of several sources end to end, read from each source on access."""

  def __init__(self, parts: Sequence[ExampleSource]):
    self.parts = list(parts)
    self._ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)

  def __len__(self) -> int:
    return int(self._ends[-1]) if self.parts else 0

  def __getitem__(self, k: int) -> dict | None:
    k = int(k)
    if not 0 <= k < len(self):
      raise IndexError(f"example {k} of {len(self)}")
    i = int(np.searchsorted(self._ends, k, side="right"))
    return self.parts[i][k - int(self._ends[i] - len(self.parts[i]))]

  def kept_lengths(self) -> np.ndarray:
    return np.concatenate([p.kept_lengths() for p in self.parts]).astype(np.int64)

  def record_lengths(self) -> np.ndarray:
    return np.concatenate([p.record_lengths() for p in self.parts]).astype(np.int64)

  def take(self, indices) -> ExampleSource:
    return _TakenExamples(self, np.asarray(indices, dtype=np.int64))

  def with_max_length(self, max_length: int) -> ConcatExamples:
    return ConcatExamples([p.with_max_length(max_length) for p in self.parts])

  def length_view(self) -> ConcatExamples:
    return ConcatExamples([p.length_view() for p in self.parts])

  @property
  def tokenizer_digest(self) -> str | None:
    """The sources' common tokenizer digest; None unless every source recorded the same one."""
    digests = {p.tokenizer_digest for p in self.parts}
    return digests.pop() if len(digests) == 1 else None


class _TakenExamples(ExampleSource):
  """The examples of `base` at `indices`, in that order (a view: nothing is read)."""

  def __init__(self, base: ExampleSource, indices: np.ndarray):
    self.base, self.indices = base, indices

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, k: int) -> dict | None:
    return self.base[int(self.indices[k])]

  def record_lengths(self) -> np.ndarray:
    return self.base.record_lengths()[self.indices]

  def kept_lengths(self) -> np.ndarray:
    lengths = self.record_lengths()
    return lengths[lengths > 0]

  def take(self, indices) -> ExampleSource:
    return _TakenExamples(self.base, self.indices[np.asarray(indices, dtype=np.int64)])

  def with_max_length(self, max_length: int) -> ExampleSource:
    return _TakenExamples(self.base.with_max_length(max_length), self.indices)

  def length_view(self) -> ExampleSource:
    return _TakenExamples(self.base.length_view(), self.indices)

  @property
  def tokenizer_digest(self) -> str | None:
    return self.base.tokenizer_digest


def concat_tokenized(parts: Sequence[TokenizedRecords]) -> TokenizedRecords:
  """The sources' tokenizations end to end (all made with one max_length and train_on)."""
  settings = {(t.max_length, t.train_on) for t in parts}
  if len(settings) != 1:
    raise ValueError(f"the sources were tokenized with different (max_length, train_on): {sorted(settings)}")
  (max_length, train_on), = settings
  return TokenizedRecords(ConcatExamples([t.examples for t in parts]),
                          np.concatenate([t.full_lengths for t in parts]).astype(np.int64), max_length, train_on)
