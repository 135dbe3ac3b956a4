"""Chat records to token ids and labels, masked from the reply spans of the rendered text.

A record `{"messages": [...]}` is rendered with the tokenizer's chat template and its trained
character spans located by the reply-span rule (template.py: `render_with_spans`, the reference,
and `SpanRenderer`, its fast path), then tokenized once with character offsets. A token is trained
when its character span overlaps a trained span: with SmolLM2 a reply that starts with "\\n" merges
with the "\\n" after `assistant` into one token, which is then trained (the token-prefix approach
would misalign here). Labels are never derived from comparing ids with the pad or eos id
(SmolLM2's pad == eos == `<|im_end|>`).

Two encoders: `tokenize_example` (one record, the reference) and `tokenize_records` (many, through
`encode_batches`), which returns a `TokenizedRecords`: the tokenization a caller keeps and passes to
the pipeline's entry points so that they encode nothing again. `encode_batches` is also what the
token store (store.py) writes, so both give exactly `tokenize_example`'s examples.

A record the template cannot label (its reply cannot be located, or the template's
`raise_exception` rejects it) is bad data: `tokenize_records` raises `DataError` naming where the
record was read (a `records.Record`), else its index. `tokenize_file` and the token store render
each record as it is loaded, so such a record is raised or skipped (`on_error="skip"`) and reported
like the loader's own bad records. (A reply whose characters map to no token shows only once its
batch is encoded: it is raised, named the same way, under either policy.)

Labels from character offsets need every token's offsets (a Python list per example, ~15% of the
encode time). For byte-level BPE tokenizers without a normalizer or offset trimming, every token
covers at least one character and offsets never decrease, so the overlapping tokens of a span
[s, e) are one contiguous run: from the first token containing character s to the last token
containing character e - 1, found with `char_to_token` and `token_to_chars` (a few calls per span).
Other tokenizers use the offsets.
"""

from __future__ import annotations

import array
import concurrent.futures
import dataclasses
import json
from typing import Iterable, Iterator, Sequence

import numpy as np

from jaxsft.data.examples import ExampleList, TokenizedRecords
from jaxsft.data.records import DataError, SkipReport, iter_records
from jaxsft.data.template import SpanRenderer, render_with_spans
from jaxsft.labels import IGNORE_INDEX


def record_error(e: ValueError, record, index: int | None = None) -> DataError:
  """A record's tokenization failure as a `DataError` naming where the record was read (a
  `records.Record`), else `record {index}`."""
  where = getattr(record, "where", None) or (None if index is None else f"record {index}")
  return DataError(getattr(e, "reason", str(e)), path=getattr(record, "path", None), where=where,
                   field=getattr(e, "field", None))


def _labels_from_offsets(ids: np.ndarray, offsets: np.ndarray, spans) -> np.ndarray:
  """labels[t] = ids[t] where token t's characters overlap a trained span, else -100."""
  labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
  starts, ends = offsets[:, 0], offsets[:, 1]
  nonempty = ends > starts
  for s, e in spans:
    hit = nonempty & (starts < e) & (ends > s)
    if not hit.any():
      raise ValueError(f"the reply at characters [{s}, {e}) maps to no token")
    labels[hit] = ids[hit]
  return labels


def _finish(ids, offsets, spans, max_length) -> tuple[dict | None, int]:
  ids = np.asarray(ids, dtype=np.int32)
  labels = _labels_from_offsets(ids, np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)
  full_length = len(ids)
  ids, labels = ids[:max_length], labels[:max_length]
  if not (labels != IGNORE_INDEX).any():
    return None, full_length
  return {"input_ids": ids, "labels": labels}, full_length


def fast_backend(tokenizer):
  """The Rust tokenizer (`tokenizers.Tokenizer`) of a fast Hugging Face tokenizer; TypeError for a slow one."""
  backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
  if backend is None or not getattr(tokenizer, "is_fast", True):
    raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer: character offsets are needed "
                    "to mask labels (load it with use_fast=True)")
  return backend


def tokenize_example(tokenizer, record: dict, *, max_length: int, train_on: str = "all_assistant") -> dict | None:
  """Tokenizes one chat record into input ids and labels.

  Args:
    tokenizer: a fast Hugging Face tokenizer.
    record: `{"messages": [...]}` ending with an assistant turn (see `load_records`).
    max_length: longer examples keep their first `max_length` tokens.
    train_on: `"all_assistant"` (every reply) or `"last"` (only the final reply).

  Returns:
    `{"input_ids": int32[L], "labels": int32[L]}` with `L <= max_length` and labels -100 on every
    token outside the trained replies, or None when truncation left no trained token.
  """
  return encode_with_length(tokenizer, record, max_length=max_length, train_on=train_on)[0]


def encode_with_length(tokenizer, record: dict, *, max_length: int, train_on: str) -> tuple[dict | None, int]:
  """`tokenize_example` plus the token count before truncation (the pipeline counts truncations)."""
  text, spans = render_with_spans(tokenizer, record, train_on=train_on)
  enc = fast_backend(tokenizer).encode(text, add_special_tokens=False)
  return _finish(enc.ids, enc.offsets, spans, max_length)


def _contiguous_offsets(backend) -> bool:
  """True when every token covers >= 1 character and offsets never decrease: byte-level BPE with
  no normalizer and no post-processor that trims offsets."""
  try:
    spec = json.loads(backend.to_str())
  except (AttributeError, TypeError, ValueError):  # not a `tokenizers.Tokenizer`: the offsets decide
    return False
  pre, post = spec.get("pre_tokenizer") or {}, spec.get("post_processor") or {}
  pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
  posts = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
  byte_level = any(p.get("type") == "ByteLevel" for p in pres)
  trims = any(p.get("type") in ("ByteLevel", "RobertaProcessing") and p.get("trim_offsets", True) for p in posts)
  return (spec.get("normalizer") is None and byte_level and not trims
          and (spec.get("model") or {}).get("type") == "BPE")


def _trained_runs(enc, spans, num_tokens: int) -> list[tuple[int, int]] | None:
  """Token ranges [a, b) overlapping each span, from `char_to_token` (contiguous offsets only);
  None when a boundary character maps to no token (then the offsets decide)."""
  runs = []
  for s, e in spans:
    a, b = enc.char_to_token(s), enc.char_to_token(e - 1)
    if a is None or b is None:
      return None
    while a > 0 and enc.token_to_chars(a - 1)[1] > s:
      a -= 1
    while b + 1 < num_tokens and enc.token_to_chars(b + 1)[0] < e:
      b += 1
    runs.append((a, b + 1))
  return runs


@dataclasses.dataclass
class EncodedBatch:
  """Consecutive records encoded: the kept examples' tokens back to back.

  `token_ids` int32[T] and `trained` bool[T] (labels = token_ids where trained, else -100) hold the
  kept examples' first `max_length` tokens in record order; per record `lengths` (0 when dropped:
  no trained token left), `full_lengths` (before truncation) and `first_trained` (index of the
  first trained token, -1 when dropped), all int64.
  """

  token_ids: np.ndarray
  trained: np.ndarray
  lengths: np.ndarray
  full_lengths: np.ndarray
  first_trained: np.ndarray

  def examples(self) -> list[dict | None]:
    out, at = [], 0
    for n in self.lengths.tolist():
      if n == 0:
        out.append(None)
        continue
      ids = self.token_ids[at:at + n]
      out.append({"input_ids": ids, "labels": np.where(self.trained[at:at + n], ids, IGNORE_INDEX).astype(np.int32)})
      at += n
    return out


Rendered = tuple[dict, str, list[tuple[int, int]]]  # (record, text, spans) as `SpanRenderer` gives them


def encode_batches(tokenizer, records: Iterable[dict], *, max_length: int, train_on: str = "all_assistant",
                   batch_size: int = 512, first_index: int = 0) -> Iterator[EncodedBatch]:
  """`tokenize_example` over a stream of records, `batch_size` at a time, as `EncodedBatch`es.

  The Rust tokenizer's `encode_batch` runs on a thread (it releases the GIL and uses its own
  threads where `TOKENIZERS_PARALLELISM` allows) while this thread renders the next batch and
  computes the labels of the previous one; at most three batches are held at once. A record the
  template cannot label raises `DataError` (see the module docstring); `first_index` is the index
  of the first record, for records that do not know where they were read.
  """
  renderer = SpanRenderer(tokenizer, train_on=train_on)

  def rendered():
    for index, record in enumerate(records, first_index):
      try:
        text, spans = renderer(record)
      except ValueError as e:
        raise record_error(e, record, index) from None
      yield record, text, spans

  yield from encode_rendered(tokenizer, rendered(), max_length=max_length, batch_size=batch_size,
                             first_index=first_index)


def encode_rendered(tokenizer, rendered: Iterable[Rendered], *, max_length: int, batch_size: int = 512,
                    first_index: int = 0) -> Iterator[EncodedBatch]:
  """`encode_batches` of records already rendered: `(record, text, spans)` items, from
  `iter_rendered` (the record only names a failure to label it)."""
  backend = fast_backend(tokenizer)
  contiguous = _contiguous_offsets(backend)

  def rendered_batches():
    batch = []
    for item in rendered:
      batch.append(item)
      if len(batch) == batch_size:
        yield batch
        batch = []
    if batch:
      yield batch

  encode = lambda batch: backend.encode_batch([text for _, text, _ in batch], add_special_tokens=False)
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    pending = None  # (future of encodings, the batch, index of its first record)
    start = first_index
    for batch in rendered_batches():
      submitted = (pool.submit(encode, batch), batch, start)
      start += len(batch)
      if pending is not None:
        yield _labels_batch(pending[0].result(), pending[1], pending[2], max_length, contiguous)
      pending = submitted
    if pending is not None:
      yield _labels_batch(pending[0].result(), pending[1], pending[2], max_length, contiguous)


def iter_rendered(tokenizer, path, *, train_on: str = "all_assistant", **load) -> Iterator[Rendered]:
  """`records.iter_records(path, **load)` with each record rendered (`SpanRenderer`) as it is read,
  as `(record, text, spans)`: a record the chat template cannot label is a bad record like the
  loader's own, raised as `DataError` naming its file and line, or skipped and reported."""
  renderer = SpanRenderer(tokenizer, train_on=train_on)
  out = None

  def check(record):
    nonlocal out
    out = renderer(record)

  for record in iter_records(path, check=check, **load):
    yield record, *out


def _labels_batch(encodings, batch: list[Rendered], first_index: int, max_length: int,
                  contiguous: bool) -> EncodedBatch:
  n = len(encodings)
  lengths, full_lengths = np.zeros(n, np.int64), np.zeros(n, np.int64)
  first_trained = np.full(n, -1, np.int64)
  ids_out = array.array("i")
  runs_out = []  # (flat offset, a, b) trained token ranges of kept examples
  for j, (enc, (record, _, spans)) in enumerate(zip(encodings, batch)):
    ids = enc.ids
    full = full_lengths[j] = len(ids)
    runs = _trained_runs(enc, spans, full) if contiguous else None
    if runs is None:
      labels = _labels_or_raise(ids, enc.offsets, spans, record, first_index + j)
      trained = np.flatnonzero(labels != IGNORE_INDEX)
      runs = _runs_of(trained)
    keep = min(full, max_length)
    kept_runs = [(a, min(b, keep)) for a, b in runs if a < keep]
    if not kept_runs:
      continue
    base = len(ids_out)
    ids_out.extend(ids[:keep])
    lengths[j], first_trained[j] = keep, min(a for a, _ in kept_runs)
    runs_out += [(base + a, base + b) for a, b in kept_runs]
  token_ids = np.frombuffer(ids_out, dtype=np.int32) if len(ids_out) else np.zeros(0, np.int32)
  trained = np.zeros(len(token_ids), dtype=bool)
  for a, b in runs_out:
    trained[a:b] = True
  return EncodedBatch(token_ids, trained, lengths, full_lengths, first_trained)


def _labels_or_raise(ids, offsets, spans, record, index: int) -> np.ndarray:
  try:
    return _labels_from_offsets(np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64).reshape(-1, 2),
                                spans)
  except ValueError as e:
    raise record_error(e, record, index) from None


def _runs_of(positions: np.ndarray) -> list[tuple[int, int]]:
  """Sorted positions -> maximal [a, b) runs of consecutive positions."""
  if not len(positions):
    return []
  breaks = np.flatnonzero(np.diff(positions) != 1)
  starts = np.concatenate([[positions[0]], positions[breaks + 1]])
  ends = np.concatenate([positions[breaks], [positions[-1]]]) + 1
  return list(zip(starts.tolist(), ends.tolist()))


def tokenize_records(tokenizer, records: Sequence[dict], *, max_length: int, train_on: str = "all_assistant",
                     batch_size: int = 512) -> TokenizedRecords:
  """`tokenize_example` over many records, through `encode_batches` (one template render per
  record, `batch_size` texts per `encode_batch` call).

  Returns:
    A `TokenizedRecords` (the examples and their lengths before truncation), to pass to
    `make_batches`, `batch_shapes` and `count_batches` so that none of them tokenizes again.
  """
  batches = encode_batches(tokenizer, records, max_length=max_length, train_on=train_on, batch_size=batch_size)
  return _collect(batches, max_length, train_on)


def tokenize_file(tokenizer, path, *, max_length: int, train_on: str = "all_assistant", fmt: str = "auto",
                  field_map: dict | None = None, on_error: str = "raise", report: SkipReport | None = None,
                  batch_size: int = 512) -> tuple[list[dict], TokenizedRecords]:
  """`load_records` then `tokenize_records` in one pass, each record rendered once.

  A record the chat template cannot label is one more bad record for the loader: it raises
  `DataError` naming the file and line, or with `on_error="skip"` is left out and counted in
  `report` (so the records returned all tokenize).
  """
  records = []

  def kept():
    for item in iter_rendered(tokenizer, path, train_on=train_on, fmt=fmt, field_map=field_map, on_error=on_error,
                              report=report):
      records.append(item[0])
      yield item

  tokenized = _collect(encode_rendered(tokenizer, kept(), max_length=max_length, batch_size=batch_size), max_length,
                       train_on)
  return records, tokenized


def _collect(batches: Iterable[EncodedBatch], max_length: int, train_on: str) -> TokenizedRecords:
  examples = ExampleList()
  full_lengths = []
  for batch in batches:
    examples += batch.examples()
    full_lengths.append(batch.full_lengths)
  full = np.concatenate(full_lengths) if full_lengths else np.zeros(0, np.int64)
  return TokenizedRecords(examples, full, max_length, train_on)
