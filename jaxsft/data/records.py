"""Instruction data files to normalized chat records.

Every record becomes `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
ending with an assistant turn. Supported record formats (`fmt`, or detected per record):

- `alpaca`: `instruction`, optional `input`, `output`, optional `system`. A non-empty `input` is
  appended to the instruction after a blank line (`instruction + "\\n\\n" + input`), which is how
  Alpaca's prompt puts the input after the instruction.
- `messages` (OpenAI style): `messages: [{"role", "content"}, ...]`; a content may be a list of
  text parts (`[{"type": "text", "text": ...}]`, joined), a `developer` turn is a system turn, and
  an assistant turn's `"weight": 0` keeps its reply untrained (`"weight"` is 0 or 1).
- `sharegpt`: `conversations: [{"from", "value"}, ...]` with `from` in human/gpt/system
  (user/assistant accepted too).
- `prompt_completion`: `prompt` and `completion`, both strings (one user and one assistant turn)
  or both message lists (TRL's conversational form).

Files are a JSON array or JSONL, optionally gzip-compressed (`.gz`), the container detected from
the first non-blank character; a `.csv` or `.tsv` file (`.gz` too) with a header line, a column
per field, every cell read as text; or Arrow data read through pyarrow: a `.parquet` file, an `.arrow`
file (IPC stream or file format), a folder of parquet shards, or a folder written by Hugging Face
`datasets`' `save_to_disk` (`state.json` listing `data-*.arrow` shards in the IPC stream format;
a `DatasetDict` folder (`dataset_dict.json`) gives its `train` split); those through pyarrow are
read in `tables.py`. Records are streamed: JSONL
line by line, a JSON array element by element, Arrow in record batches, so memory does not grow
with the file. Text is UTF-8 (a leading byte-order mark is allowed); JSONL lines are decoded one
by one, so a line that is not UTF-8 is a bad record like any other. Bad input raises `DataError`
naming the file, the line (JSONL), index (JSON array) or row (Arrow, with the shard), and the field.
Records are `Record`s: dicts that remember that file and position, so that a problem found later
(a chat template that cannot render one) names them too.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import logging
import os
import sys
import zlib
from typing import Any, Callable, Iterator, Sequence

from jaxsft.config_checks import FORMATS, ON_ERROR  # the config's lists of choices (data.format, data.on_error)
from jaxsft.data.json_array import BOM, JsonTextError, Utf8Reader, read_json_array, utf8_error
from jaxsft.errors import JaxsftError, one_line

logger = logging.getLogger("jaxsft.data")

ROLES = ("system", "user", "assistant")
# OpenAI's `developer` turn is its newer name for the system turn (the chat templates know `system`).
_MESSAGE_ROLES = {**{r: r for r in ROLES}, "developer": "system"}
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system"}
# The keys whose presence identifies a format, in detection order.
_SIGNATURES = (("messages", ("messages",)), ("sharegpt", ("conversations",)),
               ("alpaca", ("instruction", "output")), ("prompt_completion", ("prompt", "completion")))
_FORMAT_NAMES = {"alpaca": "an Alpaca", "prompt_completion": "a prompt/completion"}


class DataError(JaxsftError, ValueError):
  """Bad instruction data: the message names the file, the line or index, and the field."""

  def __init__(self, message: str, *, path: str | None = None, where: str | None = None,
               field: str | None = None):
    self.path, self.where, self.field, self.reason = path, where, field, message
    parts = [p for p in (path, where, f"field {field!r}" if field else None) if p]
    super().__init__(f"{': '.join(parts)}: {message}" if parts else message)

  def with_skip_hint(self, setting: str) -> "DataError":
    """This error, and where it names one record (`where`), how to go on without such records:
    `setting` is the command's spelling of on_error="skip" (`data.on_error=skip`, `--on-error skip`)."""
    if self.where is None:
      return self
    return DataError(f"{self.reason}; {setting} leaves such records out, counted and reported", path=self.path,
                     where=self.where, field=self.field)


class Record(dict):
  """A normalized record that remembers where it was read (`path`, and `where` as in DataError).

  Otherwise a plain dict: equality, JSON and `dict(record)` see only its items.
  """

  __slots__ = ("path", "where")

  def __init__(self, items: dict, path: str | None = None, where: str | None = None):
    super().__init__(items)
    self.path, self.where = path, where

  def __reduce__(self):  # pickled (to a Grain worker) with its position
    return Record, (dict(self), self.path, self.where)


@dataclasses.dataclass
class SkipReport:
  """What `load_records(..., report=SkipReport())` read and left out: `total` records in the file,
  one `(where, reason)` per skipped record (only `on_error="skip"` skips)."""

  path: str = ""
  total: int = 0
  skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)

  @property
  def num_skipped(self) -> int:
    return len(self.skipped)

  def reasons(self) -> dict[str, int]:
    """Skipped-record counts per reason (field + problem, without the position)."""
    return dict(collections.Counter(reason for _, reason in self.skipped))

  def summary(self) -> str:
    if not self.skipped:
      return f"{self.path}: kept all {self.total} records"
    return "\n".join([f"{self.path}: skipped {self.num_skipped} of {self.total} records",
                      *skip_lines(self.reasons(), self.skipped[:3])])


def skip_lines(reasons: dict[str, int], first: Sequence[tuple[str, str]]) -> list[str]:
  """The lines under a count of skipped records: each reason's count, most first, then where the
  `first` skipped records were and why."""
  return ([f"  {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])] +
          [f"  first: {where}: {reason}" for where, reason in first])


def load_records(path: str | os.PathLike, fmt: str = "auto", field_map: dict[str, str] | None = None,
                 on_error: str = "raise", report: SkipReport | None = None,
                 check: Callable[[dict], Any] | None = None) -> list[dict]:
  """Loads an instruction data file as normalized chat records.

  Args:
    path: a JSON array or JSONL file (optionally `.gz`), a parquet or Arrow file, or a folder of
      parquet shards or from `datasets`' `save_to_disk`.
    fmt: `"auto"` (detect each record from its keys) or one of `FORMATS`.
    field_map: canonical field name -> the name used in this file, e.g.
      `{"instruction": "question", "output": "answer"}`. Canonical names: instruction, input,
      output, system, messages, conversations, prompt, completion, and inside turns role,
      content, from, value.
    on_error: `"raise"` (the first bad record raises `DataError`) or `"skip"` (bad records are
      left out and a warning summary is logged).
    report: a `SkipReport` filled in place with the file, the records read and each skipped
      record with where it was and why.
    check: called with each normalized record; a ValueError it raises (e.g. the chat template
      cannot render the record) makes the record bad like the loader's own checks do.

  Returns:
    A list of `{"messages": [...]}` dicts (`Record`s). An empty file, or one where nothing is left
    after skipping, raises `DataError`.
  """
  return list(iter_records(path, fmt=fmt, field_map=field_map, on_error=on_error, report=report, check=check))


def iter_records(path: str | os.PathLike, fmt: str = "auto", field_map: dict[str, str] | None = None,
                 on_error: str = "raise", report: SkipReport | None = None,
                 check: Callable[[dict], Any] | None = None) -> Iterator[dict]:
  """`load_records` as a stream: yields each normalized record as it is read (the checks for an
  empty file and for nothing left after skipping run when the stream ends)."""
  if on_error not in ON_ERROR:
    raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
  if fmt != "auto" and fmt not in FORMATS:
    raise ValueError(f"fmt must be 'auto' or one of {FORMATS}, got {fmt!r}")
  path = os.fspath(path)
  field_map = dict(field_map or {})
  report = report if report is not None else SkipReport()
  report.path, report.total, report.skipped = path, 0, []
  kept = 0
  for where, raw in _read_raw(path):
    report.total += 1
    try:
      if isinstance(raw, _BadLine):
        raise DataError(raw.reason)
      record = Record(normalize_record(raw, fmt=fmt, field_map=field_map), path, where)
      if check is not None:
        check(record)
    except ValueError as e:  # DataError, or what `check` raises
      reason, field = getattr(e, "reason", str(e)), getattr(e, "field", None)
      if on_error == "raise":
        raise DataError(reason, path=path, where=where, field=field) from None
      report.skipped.append((where, f"field {field!r}: {reason}" if field else reason))
      continue
    kept += 1
    yield record
  if report.total == 0:
    raise DataError("no records (empty file or empty array)", path=path)
  if not kept:  # the error carries the report: not logged as well
    raise DataError(f"every record was invalid:\n{report.summary()}", path=path)
  if report.skipped:
    logger.warning("%s", report.summary())


def iter_raw(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
  """`(where, raw)` for each record of a data file as read, before `normalize_record`; a line that
  is not UTF-8 or not JSON raises `DataError` naming it (for readers with their own record rules,
  like the chat CLI's prompts)."""
  path = os.fspath(path)
  for where, raw in _read_raw(path):
    if isinstance(raw, _BadLine):
      raise DataError(raw.reason, path=path, where=where)
    yield where, raw


@dataclasses.dataclass(frozen=True)
class _BadLine:
  """A JSONL line that cannot be a record (not UTF-8, not JSON): `iter_records` raises or skips it."""

  reason: str


def no_such_data(path: str | os.PathLike) -> DataError:
  """The error for a data path that is not there; a hub dataset id (`owner/name`) is told how to
  make it a folder jaxsft reads, as jaxsft downloads no data."""
  path = os.fspath(path)
  hint = ""
  if path.count("/") == 1 and not path.startswith((".", "/", "~")) and "." not in path.rsplit("/", 1)[1]:
    hint = (" (a Hugging Face hub dataset is not downloaded here: save it with datasets' "
            "load_dataset(...).save_to_disk(FOLDER), or to_json(FILE), and pass that)")
  return DataError(f"no such file{hint}", path=path)


def _open_binary(path: str):
  return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _read_raw(path: str) -> Iterator[tuple[str, Any]]:
  """Yields `(where, raw_record)`; `where` is "index i" (JSON array), "line n" (JSONL) or
  "row i" (Arrow; "SHARD row i" in a folder of several)."""
  from jaxsft.data import tables  # it reads with pyarrow, imported only for such files

  if os.path.isdir(path) or path.endswith(tables.ARROW_SUFFIXES):
    yield from tables.read_arrow(path)
    return
  delimiter = next((d for suffix, d in tables.DELIMITED_SUFFIXES.items() if path.endswith(suffix)), None)
  if delimiter is not None:
    yield from tables.read_delimited(path, delimiter)
    return
  if not os.path.isfile(path):
    raise no_such_data(path)
  try:
    with _open_binary(path) as f:
      first = _first_byte(f)
      if first is None:
        raise DataError("empty file", path=path)
    with _open_binary(path) as f:
      if first == b"[":
        yield from read_json_array(Utf8Reader(f))
      else:
        yield from _read_jsonl(f)
  except JsonTextError as e:
    raise DataError(e.reason, path=path, where=f"line {e.line}") from None
  except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:  # zlib: a damaged .gz stream
    raise DataError(f"cannot read: {one_line(e)}", path=path) from None


def _first_byte(f) -> bytes | None:
  """The first byte after a byte-order mark and whitespace; None for a blank file."""
  start = True
  while chunk := f.read(4096):
    if start and chunk.startswith(BOM):
      chunk = chunk[len(BOM):]
    start = False
    stripped = chunk.lstrip()
    if stripped:
      return stripped[:1]
  return None


def _read_jsonl(f) -> Iterator[tuple[str, Any]]:
  """`(where, raw)` per non-blank line of a binary file; `raw` is a `_BadLine` for a line that is
  not UTF-8 or not JSON (each line is decoded alone, so a bad one does not stop the file)."""
  for lineno, data in enumerate(f, start=1):
    if lineno == 1 and data.startswith(BOM):
      data = data[len(BOM):]
    try:
      line = data.decode("utf-8")
    except UnicodeDecodeError as e:
      yield f"line {lineno}", _BadLine(utf8_error(data[e.start], len(data[:e.start].decode("utf-8")) + 1))
      continue
    if not line.strip():
      continue
    try:
      raw = json.loads(line.rstrip("\r\n"))  # columns count within the line, not past its newline
    except json.JSONDecodeError as e:
      raw = _BadLine(f"invalid JSON: {e.msg} (column {e.colno})")
    except RecursionError:
      raw = _BadLine(f"JSON nested deeper than Python's recursion limit ({sys.getrecursionlimit()})")
    yield f"line {lineno}", raw


def normalize_record(raw: Any, *, fmt: str = "auto", field_map: dict[str, str] | None = None) -> dict:
  """One raw record to `{"messages": [...]}`; raises `DataError` (with `.field`) if it is bad."""
  if not isinstance(raw, dict):
    raise DataError(f"expected a JSON object, got {type(raw).__name__}")
  fm = field_map or {}
  get = lambda d, key: d.get(fm.get(key, key))
  has = lambda d, key: fm.get(key, key) in d
  fieldname = lambda key: fm.get(key, key)
  if fmt == "auto":
    fmt = next((name for name, keys in _SIGNATURES if all(has(raw, k) for k in keys)), None)
    # Keys that partly match one format: the missing one is the likely mistake, not the format.
    partial = [(name, keys) for name, keys in _SIGNATURES if fmt is None and any(has(raw, k) for k in keys)]
    if len(partial) == 1:
      name, keys = partial[0]
      missing = next(k for k in keys if not has(raw, k))
      raise DataError(f"missing (keys {sorted(raw)} look like {_FORMAT_NAMES[name]} record, which needs "
                      f"{' and '.join(repr(fieldname(k)) for k in keys)})", field=fieldname(missing))
    if fmt is None and has(raw, "text"):  # a language-modeling corpus (TRL's "text" datasets)
      raise DataError("plain text, with no reply to train: jaxsft trains the assistant replies of chat records; "
                      "give each record a prompt and a completion (or instruction and output, or messages)",
                      field=fieldname("text"))
    if fmt is None:
      raise DataError(f"unknown record format: keys {sorted(raw)}; expected one of "
                      "messages, conversations, instruction+output, prompt+completion (or pass field_map)")

  def text(d, key, *, optional=False, where=""):
    value = get(d, key)
    if value is None and optional:
      return ""
    if value is None:
      raise DataError("missing", field=where + fieldname(key))
    if not isinstance(value, str):
      raise DataError(f"must be a string, got {type(value).__name__}", field=where + fieldname(key))
    return value

  if fmt == "alpaca":
    instruction, extra = text(raw, "instruction"), text(raw, "input", optional=True)
    system = text(raw, "system", optional=True)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"{instruction}\n\n{extra}" if extra.strip() else instruction},
        {"role": "assistant", "content": text(raw, "output")}]
  elif fmt == "prompt_completion":
    prompt, completion = get(raw, "prompt"), get(raw, "completion")
    if isinstance(prompt, list) or isinstance(completion, list):
      messages = (_turns(prompt, "prompt", fm, role_key="role", content_key="content")
                  + _turns(completion, "completion", fm, role_key="role", content_key="content"))
    else:
      messages = [{"role": "user", "content": text(raw, "prompt")},
                  {"role": "assistant", "content": text(raw, "completion")}]
  elif fmt == "messages":
    messages = _turns(get(raw, "messages"), fieldname("messages"), fm, role_key="role", content_key="content")
  else:  # sharegpt
    messages = _turns(get(raw, "conversations"), fieldname("conversations"), fm, role_key="from",
                      content_key="value", roles=_SHAREGPT_ROLES)
  _check_conversation(messages, fmt=fmt, fm=fm)
  return {"messages": messages}


def _turns(value, field: str, fm: dict, *, role_key: str, content_key: str, roles=None) -> list[dict]:
  if value is None:
    raise DataError("missing", field=field)
  if not isinstance(value, list) or not value:
    raise DataError("must be a non-empty list of turns", field=field)
  role_key, content_key = fm.get(role_key, role_key), fm.get(content_key, content_key)
  turns = []
  for i, turn in enumerate(value):
    here = f"{field}[{i}]"
    if not isinstance(turn, dict):
      raise DataError(f"must be an object, got {type(turn).__name__}", field=here)
    role, content = turn.get(role_key), turn.get(content_key)
    if not isinstance(role, str):
      raise DataError("missing" if role is None else "must be a string", field=f"{here}.{role_key}")
    role = (roles or _MESSAGE_ROLES).get(role)
    if role is None:
      raise DataError(f"unknown role {turn.get(role_key)!r} (expected one of "
                      f"{sorted(roles or _MESSAGE_ROLES)})", field=f"{here}.{role_key}")
    if content is None:
      raise DataError("a tool call, not a text turn: only text is trained" if turn.get("tool_calls") else "missing",
                      field=f"{here}.{content_key}")
    if isinstance(content, list):
      content = _text_of_parts(content, f"{here}.{content_key}")
    if not isinstance(content, str):
      raise DataError(f"must be a string, got {type(content).__name__}", field=f"{here}.{content_key}")
    turns.append({"role": role, "content": content, **_weight(turn, role, f"{here}.weight")})
  return turns


def _weight(turn: dict, role: str, field: str) -> dict:
  """OpenAI's per-turn `weight`: 0 on an assistant turn keeps that reply out of the loss (it stays
  in the prompt), 1 trains it as a turn without the key. `{"weight": 0}` to merge into the
  normalized turn, else {}: a record without weights normalizes as before."""
  if "weight" not in turn:
    return {}
  weight = turn["weight"]
  if type(weight) is not int or weight not in (0, 1):
    raise DataError(f"must be 0 or 1, got {weight!r}", field=field)
  if role != "assistant":
    raise DataError(f"only an assistant turn has a weight (this one is {role!r})", field=field)
  return {"weight": 0} if weight == 0 else {}


def _text_of_parts(parts: list, field: str) -> str:
  """A turn's content given as OpenAI's list of parts (`[{"type": "text", "text": ...}, ...]`):
  its text parts joined as one string, in order and with nothing between them, as the chat
  templates of multimodal models write consecutive parts. Any other part (an image, audio) is
  refused: a text model has no tokens for it."""
  texts = []
  for i, part in enumerate(parts):
    if not isinstance(part, dict) or part.get("type") != "text":
      kind = part.get("type") if isinstance(part, dict) else type(part).__name__
      raise DataError(f"content part {kind!r}: only text parts ({{'type': 'text', 'text': ...}}) can be trained",
                      field=f"{field}[{i}]")
    if not isinstance(part.get("text"), str):
      raise DataError("must be a string" if "text" in part else "missing", field=f"{field}[{i}].text")
    texts.append(part["text"])
  return "".join(texts)


def _check_conversation(messages: list[dict], *, fmt: str, fm: dict) -> None:
  if messages[-1]["role"] != "assistant":
    raise DataError(f"conversation must end with an assistant turn, ends with {messages[-1]['role']!r}",
                    field=_field_of(fmt, fm, len(messages) - 1, "role"))
  for i, m in enumerate(messages):
    if m["role"] == "assistant" and not m["content"].strip():
      raise DataError("empty assistant reply", field=_field_of(fmt, fm, i, "content"))
  if all(m.get("weight") == 0 for m in messages if m["role"] == "assistant"):
    raise DataError("every assistant turn has weight 0: nothing to train", field=_field_of(fmt, fm, len(messages) - 1,
                                                                                           "weight"))


def _field_of(fmt: str, fm: dict, i: int, what: str) -> str:
  """The file's own name for turn i's role/content field, for error messages."""
  name = lambda key: fm.get(key, key)
  if fmt == "alpaca":
    return name("output")
  if fmt == "prompt_completion":
    return name("completion")
  if fmt == "sharegpt":
    return f"{name('conversations')}[{i}].{name('from' if what == 'role' else 'value')}"
  return f"{name('messages')}[{i}].{name(what)}"
