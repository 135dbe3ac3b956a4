"""Token store: a data file tokenized once into memory-mapped arrays, reused by every later run.

    CACHE_DIR/<key>/                      CACHE_DIR defaults to $JAXSFT_CACHE/tokens (~/.cache/jaxsft/tokens)
      tokens.bin        uint16 (vocabularies up to 65,536 ids) or int32: kept examples back to back
      trained.bin       uint8, 1 where the token is trained: labels = tokens where trained, else -100
      offsets.npy       int64[N+1]: record i's tokens are tokens[offsets[i]:offsets[i+1]] (empty: dropped)
      full_lengths.npy  int64[N]: token count before truncation at max_length
      first_trained.npy int64[N]: index of the first trained token (-1: dropped), so a shorter
                        max_length knows which examples it empties without reading them
      records.bin       the normalized records as UTF-8 JSON back to back (held-out records and
      record_offsets.npy  generation read a few of them; nothing else does)
      manifest.json     written last: the key's parts, counts, skip report, and every file's size
                        and CRC-32

`key` is a SHA-256 over everything that changes the tokens: the data's bytes (every file of a
folder), the tokenizer (its serialized vocabulary, merges and settings, chat template, special
tokens), max_length, train_on, format, field map, on_error and the store layout version.

A store is built in a temporary folder beside its final place and renamed into place; when two
processes build the same store, the first rename wins and the other reads that one. Opening checks
the manifest, every file's size and CRC-32; a store that fails (a build killed before its manifest,
a truncated or altered file) is reported in one line, moved aside, deleted and rebuilt, never read.

Examples are identical to `tokenize_example`'s (both come from `tokenize.encode_rendered`), and
peak memory while building does not grow with the file: records stream in, `encode_rendered`
holds three batches, arrays are appended to files; only the per-record int64 arrays (24 bytes a
record) stay in memory.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import time
import zlib
from typing import Any, Sequence

import numpy as np

from jaxsft import io
from jaxsft.io import jaxsft_cache
from jaxsft.data.records import SkipReport, no_such_data
from jaxsft.data.examples import ExampleSource, LengthOnlyExamples, RecordsWithTokens, TokenizedRecords
from jaxsft.data.template import PLAIN_CHAT_TEMPLATE, bos_prefix
from jaxsft.data.tokenize import encode_rendered, fast_backend, iter_rendered
from jaxsft.errors import JaxsftError
from jaxsft.labels import IGNORE_INDEX

logger = logging.getLogger("jaxsft.data")

# Part of every store's key: a change in how labels are derived (2: reply spans located in the
# full render, so templates that render the last turn differently label as they render) or in which
# records are kept (3: a UTF-8 byte-order mark no longer costs the first record under on_error=skip;
# 4: an assistant turn's `weight` of 0 keeps its reply untrained) builds new stores.
STORE_VERSION = 4
_ARRAYS = ("offsets", "full_lengths", "first_trained", "record_offsets")
_BLOBS = ("tokens.bin", "trained.bin", "records.bin")
_CRC_CHUNK = 1 << 24


class StoreError(JaxsftError, ValueError):
  """A token store that is missing, partial or damaged (the message says which file and why)."""


# ---------------------------------------------------------------------------------------------
# Keys.


def content_digest(path: str | os.PathLike) -> str:
  """SHA-256 of a file's bytes, or of every file under a folder (relative names and bytes, sorted)."""
  path = pathlib.Path(path)
  digest = hashlib.sha256()
  files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
  for file in files:
    digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
    with open(file, "rb") as f:
      digest.update(hashlib.file_digest(f, "sha256").digest())
  return digest.hexdigest()


def tokenizer_digest(tokenizer) -> str:
  """SHA-256 of what the tokenizer contributes to the tokens: its serialized Rust tokenizer
  (vocabulary, merges, pre-tokenizer, added tokens), chat template, special tokens and BOS rule."""
  digest = hashlib.sha256()
  for part in (fast_backend(tokenizer).to_str(), getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE,
               json.dumps(dict(tokenizer.special_tokens_map), sort_keys=True, default=str), bos_prefix(tokenizer)):
    digest.update(str(part).encode() + b"\0")
  return digest.hexdigest()  # not cached on the tokenizer: a copy with another template must differ


def store_key(path, tokenizer, *, max_length: int, train_on: str, fmt: str = "auto",
              field_map: dict | None = None, on_error: str = "raise") -> tuple[str, dict]:
  """(hex key, the parts it hashes): the store's folder name under the cache dir."""
  parts = {"version": STORE_VERSION, "data": content_digest(path), "tokenizer": tokenizer_digest(tokenizer),
           "max_length": int(max_length), "train_on": train_on, "format": fmt,
           "field_map": dict(sorted((field_map or {}).items())), "on_error": on_error}
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32], parts


# ---------------------------------------------------------------------------------------------
# Building.


class _Writer:
  """An append-only file that counts its bytes and CRC-32 as it writes."""

  def __init__(self, path: pathlib.Path):
    self.f, self.bytes, self.crc = open(path, "wb"), 0, 0

  def write(self, data) -> None:
    data = memoryview(data).cast("B")
    self.f.write(data)
    self.bytes += len(data)
    self.crc = zlib.crc32(data, self.crc)

  def close(self) -> dict:
    self.f.flush()
    os.fsync(self.f.fileno())
    self.f.close()
    return {"bytes": self.bytes, "crc32": self.crc}


def build_store(folder: str | os.PathLike, path, tokenizer, *, max_length: int, train_on: str = "all_assistant",
                fmt: str = "auto", field_map: dict | None = None, on_error: str = "raise",
                batch_size: int = 512, key_parts: dict | None = None) -> dict:
  """Tokenizes the data file `path` into the (new, empty) `folder`; returns the manifest it wrote
  last. Raises `DataError` for bad records (as `load_records` does); a record the chat template
  cannot label is one of them, rendered as it is read, so `on_error="skip"` skips and counts it."""
  folder = pathlib.Path(folder)
  t0 = time.perf_counter()
  vocab = fast_backend(tokenizer).get_vocab_size(with_added_tokens=True)
  token_dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.int32)
  report = SkipReport()
  tokens, trained, texts = (_Writer(folder / name) for name in _BLOBS)
  record_ends = array.array("q")  # 8 bytes a record (a list would hold an int object each)
  lengths, full_lengths, first_trained = [], [], []

  def records_written():
    for item in iter_rendered(tokenizer, path, train_on=train_on, fmt=fmt, field_map=field_map, on_error=on_error,
                              report=report):
      texts.write(json.dumps(item[0], ensure_ascii=False).encode())
      record_ends.append(texts.bytes)
      yield item

  try:
    for batch in encode_rendered(tokenizer, records_written(), max_length=max_length, batch_size=batch_size):
      tokens.write(batch.token_ids.astype(token_dtype, copy=False))
      trained.write(batch.trained.view(np.uint8))
      lengths.append(batch.lengths)
      full_lengths.append(batch.full_lengths)
      first_trained.append(batch.first_trained)
  finally:
    files = {name: w.close() for name, w in zip(_BLOBS, (tokens, trained, texts))}
  join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)
  lengths = join(lengths)
  arrays = {"offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "full_lengths": join(full_lengths), "first_trained": join(first_trained),
            "record_offsets": np.concatenate([[0], np.frombuffer(record_ends, np.int64)]).astype(np.int64)}
  for name, values in arrays.items():
    with open(folder / f"{name}.npy", "wb") as f:
      np.save(f, values)
      f.flush()
      os.fsync(f.fileno())
    files[f"{name}.npy"] = {"bytes": (folder / f"{name}.npy").stat().st_size,
                            "crc32": _file_crc(folder / f"{name}.npy")}
  full = arrays["full_lengths"]
  manifest = {
      "version": STORE_VERSION, "key": key_parts or {}, "source": os.path.abspath(os.fspath(path)),
      "token_dtype": token_dtype.name, "max_length": int(max_length), "train_on": train_on,
      "num_records": int(len(lengths)), "num_kept": int((lengths > 0).sum()), "num_dropped": int((lengths == 0).sum()),
      "num_truncated": int((full > max_length).sum()), "num_tokens": int(lengths.sum()),
      "records_read": report.total, "skipped": report.num_skipped, "skip_reasons": report.reasons(),
      "first_skipped": report.skipped[:3], "build_seconds": round(time.perf_counter() - t0, 3), "files": files,
  }
  with open(folder / "manifest.json", "w") as f:
    json.dump(manifest, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  return manifest


def _file_crc(path: pathlib.Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(_CRC_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


# ---------------------------------------------------------------------------------------------
# Reading.


class TokenStore:
  """An opened (and checked) store: memory-mapped arrays, examples read on access."""

  def __init__(self, folder: str | os.PathLike, *, verify: bool = True):
    self.folder = pathlib.Path(folder)
    self.manifest = check_store(self.folder, verify=verify)
    self._open()

  def _open(self):
    m, folder = self.manifest, self.folder
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
    self.offsets, self.full_lengths = arrays["offsets"], np.asarray(arrays["full_lengths"])
    self.first_trained, self.record_offsets = arrays["first_trained"], arrays["record_offsets"]
    self.max_length, self.train_on = m["max_length"], m["train_on"]
    mapped = lambda name, dtype: (np.memmap(folder / name, dtype=dtype, mode="r") if m["files"][name]["bytes"]
                                  else np.zeros(0, dtype))
    self.tokens, self.trained = mapped("tokens.bin", np.dtype(m["token_dtype"])), mapped("trained.bin", np.uint8)
    self.texts = mapped("records.bin", np.uint8)

  def __getstate__(self):  # pickled (e.g. to a Grain worker) as its folder; reopened without re-checking
    return {"folder": self.folder, "manifest": self.manifest}

  def __setstate__(self, state):
    self.folder, self.manifest = state["folder"], state["manifest"]
    self._open()

  def __len__(self) -> int:
    return self.manifest["num_records"]

  @property
  def lengths(self) -> np.ndarray:
    """int64[N] stored token counts (0: dropped)."""
    return np.diff(self.offsets)

  def example(self, i: int, max_length: int | None = None) -> dict | None:
    """Record i as `tokenize_example(..., max_length)` returns it (max_length <= the store's)."""
    max_length = self.max_length if max_length is None else max_length
    lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
    if hi == lo or self.first_trained[i] >= max_length:
      return None
    hi = min(hi, lo + max_length)
    ids = self.tokens[lo:hi].astype(np.int32)
    return {"input_ids": ids, "labels": np.where(self.trained[lo:hi], ids, IGNORE_INDEX).astype(np.int32)}

  def record(self, i: int) -> dict:
    return json.loads(self.texts[int(self.record_offsets[i]):int(self.record_offsets[i + 1])].tobytes())

  def tokenized(self, indices: Sequence[int] | None = None) -> TokenizedRecords:
    """A `TokenizedRecords` over the records at `indices` (all by default), read on access."""
    examples = StoredExamples(self, None if indices is None else np.asarray(indices, np.int64), self.max_length)
    full = self.full_lengths if indices is None else self.full_lengths[np.asarray(indices, np.int64)]
    return TokenizedRecords(examples, full, self.max_length, self.train_on)

  def records(self, indices: Sequence[int] | None = None) -> StoredRecords:
    return StoredRecords(self, None if indices is None else np.asarray(indices, np.int64))

  def summary(self) -> str:
    m = self.manifest
    reasons = "".join(f"\n  skipped {n} x {why}" for why, n in m["skip_reasons"].items())
    return (f"{m['num_kept']} examples ({m['num_tokens']:,} tokens) from {m['num_records']} records; "
            f"{m['num_dropped']} dropped (no trained token left after truncation at max_length {m['max_length']}), "
            f"{m['num_truncated']} truncated, {m['skipped']} of {m['records_read']} records skipped as invalid"
            f"{reasons}")


class _View:
  def __init__(self, store: TokenStore, indices: np.ndarray | None):
    self.store, self.indices = store, indices

  def __len__(self) -> int:
    return len(self.store) if self.indices is None else len(self.indices)

  def _index(self, k: int) -> int:
    if not -len(self) <= k < len(self):
      raise IndexError(k)
    k = k % len(self)
    return k if self.indices is None else int(self.indices[k])

  def _take(self, indices) -> np.ndarray:
    indices = np.asarray(indices, np.int64)
    return indices if self.indices is None else self.indices[indices]

  def __iter__(self):
    return (self[k] for k in range(len(self)))


class StoredExamples(_View, ExampleSource):
  """`TokenizedRecords.examples` read from a store: item k is a dict (or None when dropped) made
  from the memory-mapped arrays on access."""

  def __init__(self, store: TokenStore, indices: np.ndarray | None, max_length: int):
    super().__init__(store, indices)
    self.max_length = max_length

  def __getitem__(self, k: int) -> dict | None:
    return self.store.example(self._index(k), self.max_length)

  def kept_lengths(self) -> np.ndarray:
    """int64 lengths of the kept examples at this max_length, in order (no example is read)."""
    idx = slice(None) if self.indices is None else self.indices
    lengths, first = self.store.lengths[idx], np.asarray(self.store.first_trained[idx])
    kept = (lengths > 0) & (first < self.max_length)
    return np.minimum(lengths[kept], self.max_length).astype(np.int64)

  def record_lengths(self) -> np.ndarray:
    return np.asarray(self.length_view().lengths, dtype=np.int64)

  def take(self, indices) -> StoredExamples:
    return StoredExamples(self.store, self._take(indices), self.max_length)

  def length_view(self) -> LengthOnlyExamples:
    """Stand-ins with each example's length and no content, for counting packed batches."""
    idx = slice(None) if self.indices is None else self.indices
    lengths, first = self.store.lengths[idx], np.asarray(self.store.first_trained[idx])
    return LengthOnlyExamples(np.where((lengths > 0) & (first < self.max_length),
                                       np.minimum(lengths, self.max_length), 0))

  def with_max_length(self, max_length: int) -> StoredExamples:
    return StoredExamples(self.store, self.indices, max_length)

  @property
  def tokenizer_digest(self) -> str | None:
    return self.store.manifest.get("key", {}).get("tokenizer")


class StoredRecords(_View, Sequence, RecordsWithTokens):
  """Normalized records read from a store on access; `.tokenized` is their `TokenizedRecords`."""

  def __getitem__(self, k: int) -> dict:
    return self.store.record(self._index(k))

  def take(self, indices) -> StoredRecords:
    return StoredRecords(self.store, self._take(indices))

  @property
  def tokenized(self) -> TokenizedRecords:
    return self.store.tokenized(self.indices)


def check_store(folder: pathlib.Path, *, verify: bool = True) -> dict:
  """The manifest of a whole store; StoreError naming what is missing or damaged otherwise."""
  manifest_path = folder / "manifest.json"
  if not manifest_path.is_file():
    raise StoreError(f"{folder}: no manifest.json (a build that did not finish)")
  try:
    manifest = json.loads(manifest_path.read_text())
    files = manifest["files"]
  except (ValueError, KeyError, TypeError) as e:
    raise StoreError(f"{manifest_path}: unreadable manifest ({e})") from None
  if manifest.get("version") != STORE_VERSION:
    raise StoreError(f"{folder}: layout version {manifest.get('version')}, expected {STORE_VERSION}")
  for name in (*_BLOBS, *(f"{a}.npy" for a in _ARRAYS)):
    file = folder / name
    if name not in files or not file.is_file():
      raise StoreError(f"{file}: missing")
    size = file.stat().st_size
    if size != files[name]["bytes"]:
      raise StoreError(f"{file}: {size} bytes, the manifest says {files[name]['bytes']}")
    if verify and _file_crc(file) != files[name]["crc32"]:
      raise StoreError(f"{file}: checksum differs from the manifest's")
  return manifest


# ---------------------------------------------------------------------------------------------
# The cache.


@dataclasses.dataclass
class StoreResult:
  store: TokenStore
  built: bool  # False: an existing store was found
  seconds: float  # to find or build it


def cache_root(cache_dir: str | os.PathLike | None) -> pathlib.Path:
  """`cache_dir`, else `tokens/` in jaxsft's cache (JAXSFT_CACHE, default ~/.cache/jaxsft)."""
  if cache_dir:
    return pathlib.Path(os.path.expanduser(os.fspath(cache_dir)))
  return jaxsft_cache() / "tokens"


def open_or_build(path, tokenizer, *, max_length: int, train_on: str = "all_assistant", fmt: str = "auto",
                  field_map: dict | None = None, on_error: str = "raise",
                  cache_dir: str | os.PathLike | None = None, verify: bool = True) -> StoreResult:
  """The store of `path` under these settings: found in `cache_root(cache_dir)`, else built
  there. A damaged store is reported, removed and rebuilt."""
  t0 = time.perf_counter()
  if not os.path.exists(path):
    raise no_such_data(path)
  root = cache_root(cache_dir)
  key, parts = store_key(path, tokenizer, max_length=max_length, train_on=train_on, fmt=fmt, field_map=field_map,
                         on_error=on_error)
  final = root / key
  store = _try_open(final, verify=verify)
  if store is not None:
    return StoreResult(store, False, time.perf_counter() - t0)
  root.mkdir(parents=True, exist_ok=True)
  io.remove_leftovers(final)  # the half-built stores of builders that died
  tmp = io.make_temp_directory(final)
  try:
    with io.naming_the_target(final):  # a full disk's error names no path of its own
      build_store(tmp, path, tokenizer, max_length=max_length, train_on=train_on, fmt=fmt, field_map=field_map,
                  on_error=on_error, key_parts=parts)
    try:
      os.rename(tmp, final)  # atomic; fails if another process renamed its build in first
    except OSError:
      if not final.is_dir():
        raise
      logger.info("token store %s: another process finished the same build first; using its store", final)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return StoreResult(TokenStore(final, verify=verify), True, time.perf_counter() - t0)


def _try_open(folder: pathlib.Path, *, verify: bool) -> TokenStore | None:
  if not folder.exists():
    return None
  try:
    return TokenStore(folder, verify=verify)
  except StoreError as e:
    logger.warning("token store damaged, rebuilding it: %s", e)
    try:
      io.remove_directory(folder)  # moved aside first: a concurrent reader never sees half a store
    except OSError:
      return None  # another process moved it first
    return None


def describe(result: StoreResult) -> dict[str, Any]:
  """What `python -m jaxsft.data build` prints, as a dict."""
  m = result.store.manifest
  return {"store": str(result.store.folder), "built": result.built, "seconds": round(result.seconds, 3),
          "examples": m["num_kept"], "dropped": m["num_dropped"], "truncated": m["num_truncated"],
          "records": m["num_records"], "skipped": m["skipped"], "skip_reasons": m["skip_reasons"],
          "tokens": m["num_tokens"], "bytes": sum(f["bytes"] for f in m["files"].values())}


class RecordList(list, RecordsWithTokens):
  """A plain list of records (JSON-serializable, cheap to index) that keeps their stored
  tokenization as `.tokenized`."""

  def __init__(self, records, tokenized: TokenizedRecords):
    super().__init__(records)
    self._tokenized = tokenized

  @property
  def tokenized(self) -> TokenizedRecords:
    return self._tokenized


def stored_tokens(records, tokenizer, *, max_length: int, train_on: str) -> TokenizedRecords | None:
  """The tokenization `records` carry from a token store, when it is the one `tokenizer`,
  `max_length` and `train_on` would make; None otherwise (then the caller tokenizes)."""
  if not isinstance(records, RecordsWithTokens):
    return None
  tokenized = records.tokenized
  if tokenized.train_on != train_on or tokenized.max_length != max_length:
    return None
  made_with = tokenized.examples.tokenizer_digest
  if made_with is None or made_with != tokenizer_digest(tokenizer):
    logger.warning("the token store was made with another tokenizer than the model's: tokenizing again")
    return None
  return tokenized
