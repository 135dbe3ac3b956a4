"""Example sources: the tokenized examples of a list of records behind one interface, and
`TokenizedRecords`, the tokenization a caller keeps and passes to the pipeline's entry points.

An `ExampleSource` is held in memory (`ExampleList`, what `tokenize_records` makes) or read from a
memory-mapped token store on access (`store.StoredExamples`, whose `length_view` gives
`LengthOnlyExamples`); `TokenizedRecords` and the pipeline ask it for lengths, views and re-cuts
through the interface, whichever it is. Records that carry the tokenization a token store made of
them (`store.StoredRecords`, `store.RecordList`) are `RecordsWithTokens`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Iterable, Sequence

import numpy as np

from jaxsft.labels import IGNORE_INDEX


class ExampleSource(Sequence):
  """Item i: record i's example, `{"input_ids": int32[L], "labels": int32[L]}`, or None when
  truncation left it no trained token (the pipeline drops it)."""

  @abc.abstractmethod
  def kept_lengths(self) -> np.ndarray:
    """int64 token counts of the kept examples, in record order."""

  @abc.abstractmethod
  def record_lengths(self) -> np.ndarray:
    """int64 per record: its example's token count, 0 when dropped."""

  @abc.abstractmethod
  def take(self, indices: np.ndarray) -> ExampleSource:
    """The examples at `indices` (int64), in that order."""

  @abc.abstractmethod
  def with_max_length(self, max_length: int) -> ExampleSource:
    """The examples cut to their first `max_length` tokens (None where no trained token is left)."""

  def length_view(self) -> ExampleSource:
    """Examples with the same lengths, for what depends on the lengths only (a packer's
    placement); a source that reads its examples gives stand-ins that read nothing."""
    return self

  @property
  def tokenizer_digest(self) -> str | None:
    """The digest (`store.tokenizer_digest`) of the tokenizer that made the examples where it was
    recorded with them (a token store); None otherwise."""
    return None


class ExampleList(list, ExampleSource):
  """Examples held in memory: a list of example dicts and Nones."""

  def __init__(self, examples: Iterable[dict | None] = ()):
    super().__init__(examples)

  def kept_lengths(self) -> np.ndarray:
    return np.array([len(e["input_ids"]) for e in self if e is not None], dtype=np.int64)

  def record_lengths(self) -> np.ndarray:
    return np.array([0 if e is None else len(e["input_ids"]) for e in self], dtype=np.int64)

  def take(self, indices: np.ndarray) -> ExampleList:
    return ExampleList(self[i] for i in indices)

  def with_max_length(self, max_length: int) -> ExampleList:
    return ExampleList(None if e is None else _cut(e, max_length) for e in self)


class LengthOnlyExamples(ExampleSource):
  """Item k: None when `lengths[k]` is 0 (dropped), else zero arrays of that length (a packer's
  placement depends on the lengths only)."""

  def __init__(self, lengths: np.ndarray):
    self.lengths = lengths

  def __len__(self) -> int:
    return len(self.lengths)

  def __getitem__(self, k: int) -> dict | None:
    n = int(self.lengths[k])
    return None if n == 0 else {"input_ids": np.zeros(n, np.int32), "labels": np.zeros(n, np.int32)}

  def kept_lengths(self) -> np.ndarray:
    return np.asarray(self.lengths, dtype=np.int64)[np.asarray(self.lengths) > 0]

  def record_lengths(self) -> np.ndarray:
    return np.asarray(self.lengths, dtype=np.int64)

  def take(self, indices) -> LengthOnlyExamples:
    return LengthOnlyExamples(np.asarray(self.lengths)[np.asarray(indices, np.int64)])

  def with_max_length(self, max_length: int) -> ExampleSource:
    raise TypeError("length stand-ins cannot be cut again (which examples a cut empties is not kept): "
                    "cut the stored examples, then take their length_view()")


def _cut(example: dict, max_length: int) -> dict | None:
  labels = example["labels"][:max_length]
  return {"input_ids": example["input_ids"][:max_length], "labels": labels} if (labels != IGNORE_INDEX).any() else None


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: identity, not an elementwise array comparison
class TokenizedRecords:
  """Every record of a list tokenized once with one `max_length` and `train_on`.

  The caller owns it and passes it to `make_batches`, `batch_shapes` and `count_batches`, which
  then encode nothing; they raise ValueError when its record count, `max_length` or `train_on`
  differ from theirs. Treat it (and the records it came from) as immutable.

  Attributes:
    examples: examples[i] is `tokenize_example(...)` of records[i], None when truncation left no
      trained token (the pipeline drops it). An `ExampleSource`: an `ExampleList` in memory (a
      plain list passed in becomes one), or a `store.StoredExamples` that reads each example from
      a memory-mapped token store on access.
    full_lengths: int64[N], the token count of records[i] before truncation.
    max_length, train_on: the settings it was tokenized with.
  """

  examples: ExampleSource
  full_lengths: np.ndarray
  max_length: int
  train_on: str

  def __post_init__(self):
    if not isinstance(self.examples, ExampleSource):  # a plain sequence of examples: held in memory
      object.__setattr__(self, "examples", ExampleList(self.examples))

  def __len__(self) -> int:
    return len(self.examples)

  @property
  def lengths(self) -> np.ndarray:
    """int64 token counts (after truncation) of the kept examples, in record order (a store's come
    from its length arrays: nothing is read)."""
    return self.examples.kept_lengths()

  @property
  def num_dropped(self) -> int:
    """Records that truncation left with no trained token."""
    return len(self) - len(self.lengths)

  def require_trained(self, what: str, *, path: str | None, use: str = "train on") -> None:
    """Raises DataError naming `path`, `what` records these are and the way out when there are
    records but truncation at `max_length` left none of them a trained token: there is no batch
    to make of them (and a loss over them would be over 0 tokens)."""
    if len(self) == 0 or len(self.lengths) > 0:
      return
    from jaxsft.data.records import DataError

    raise DataError(f"{what}: all {len(self)} are cut at max_length {self.max_length} before their reply starts, "
                    f"so none has a token to {use} (the shortest is {int(self.full_lengths.min())} tokens whole); "
                    "raise --max-length", path=path)

  def take(self, indices: Sequence[int]) -> TokenizedRecords:
    """The records at `indices`, in that order (a view when backed by a store)."""
    indices = np.asarray(indices, dtype=np.int64)
    return TokenizedRecords(self.examples.take(indices), self.full_lengths[indices], self.max_length, self.train_on)

  def length_view(self) -> TokenizedRecords:
    """The same records with `examples.length_view()`: for counting packed batches without
    reading a stored example."""
    return TokenizedRecords(self.examples.length_view(), self.full_lengths, self.max_length, self.train_on)

  def with_max_length(self, max_length: int) -> TokenizedRecords:
    """The same records at a smaller `max_length`, without encoding again.

    Exact: labels are computed on the whole text before truncation keeps a prefix, so cutting a
    longer prefix again equals tokenizing at `max_length` (examples left with no trained token
    become None). A larger `max_length` is possible only if no record was cut.
    """
    if max_length == self.max_length:
      return self
    if max_length > self.max_length and (self.full_lengths > self.max_length).any():
      raise ValueError(f"cannot extend a tokenization cut at max_length {self.max_length} to {max_length}")
    return TokenizedRecords(self.examples.with_max_length(max_length), self.full_lengths, max_length, self.train_on)

  def check_matches(self, *, num_records: int | None, max_length: int, train_on: str) -> None:
    """Raises ValueError naming the first setting that differs from how these records were tokenized."""
    if num_records is not None and num_records != len(self):
      raise ValueError(f"tokenized holds {len(self)} records but {num_records} records were passed")
    if max_length != self.max_length:
      raise ValueError(f"tokenized was made with max_length={self.max_length}, but max_length={max_length} was "
                       "passed (tokenized.with_max_length(max_length) re-cuts it without encoding)")
    if train_on != self.train_on:
      raise ValueError(f"tokenized was made with train_on={self.train_on!r}, but train_on={train_on!r} was passed")


class RecordsWithTokens(abc.ABC):
  """Records that carry the tokenization a token store made of them, so a run does not encode
  them again (`store.stored_tokens` checks that it is the one the run would make)."""

  @property
  @abc.abstractmethod
  def tokenized(self) -> TokenizedRecords:
    """Their `TokenizedRecords`, record i's example at index i."""
