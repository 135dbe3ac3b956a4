"""Instruction data files to normalized chat records.

Every record becomes `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
ending with an assistant turn. Supported record formats (`fmt`, or detected per record):

- `alpaca`: `instruction`, optional `input`, `output`, optional `system`. A non-empty `input` is
  appended to the instruction after a blank line (`instruction + "\\n\\n" + input`), which is how
  Alpaca's prompt puts the input after the instruction.
- `messages` (OpenAI style): `messages: [{"role", "content"}, ...]`.
- `sharegpt`: `conversations: [{"from", "value"}, ...]` with `from` in human/gpt/system
  (user/assistant accepted too).
- `prompt_completion`: `prompt` and `completion`, both strings (one user and one assistant turn)
  or both message lists (TRL's conversational form).

Files are a JSON array or JSONL, optionally gzip-compressed (`.gz`); the container is detected
from the first non-blank character. Bad input raises `DataError` naming the file, the line (JSONL)
or index (JSON array), and the field.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import logging
import os
from typing import Any, Iterator

logger = logging.getLogger("jaxsft.data")

FORMATS = ("alpaca", "messages", "sharegpt", "prompt_completion")
ON_ERROR = ("raise", "skip")
ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system"}
# The keys whose presence identifies a format, in detection order.
_SIGNATURES = (("messages", ("messages",)), ("sharegpt", ("conversations",)),
               ("alpaca", ("instruction", "output")), ("prompt_completion", ("prompt", "completion")))


class DataError(ValueError):
  """Bad instruction data: the message names the file, the line or index, and the field."""

  def __init__(self, message: str, *, path: str | None = None, where: str | None = None,
               field: str | None = None):
    self.path, self.where, self.field, self.reason = path, where, field, message
    parts = [p for p in (path, where, f"field {field!r}" if field else None) if p]
    super().__init__(f"{': '.join(parts)}: {message}" if parts else message)


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
    lines = [f"{self.path}: skipped {self.num_skipped} of {self.total} records"]
    lines += [f"  {n} x {reason}" for reason, n in sorted(self.reasons().items(), key=lambda kv: -kv[1])]
    lines += [f"  first: {where}: {reason}" for where, reason in self.skipped[:3]]
    return "\n".join(lines)


def load_records(path: str | os.PathLike, fmt: str = "auto", field_map: dict[str, str] | None = None,
                 on_error: str = "raise", report: SkipReport | None = None) -> list[dict]:
  """Loads an instruction data file as normalized chat records.

  Args:
    path: a JSON array or JSONL file, optionally `.gz`.
    fmt: `"auto"` (detect each record from its keys) or one of `FORMATS`.
    field_map: canonical field name -> the name used in this file, e.g.
      `{"instruction": "question", "output": "answer"}`. Canonical names: instruction, input,
      output, system, messages, conversations, prompt, completion, and inside turns role,
      content, from, value.
    on_error: `"raise"` (the first bad record raises `DataError`) or `"skip"` (bad records are
      left out and a warning summary is logged).
    report: a `SkipReport` filled in place with the file, the records read and each skipped
      record with where it was and why.

  Returns:
    A list of `{"messages": [...]}` dicts. An empty file, or one where nothing is left after
    skipping, raises `DataError`.
  """
  if on_error not in ON_ERROR:
    raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
  if fmt != "auto" and fmt not in FORMATS:
    raise ValueError(f"fmt must be 'auto' or one of {FORMATS}, got {fmt!r}")
  path = os.fspath(path)
  field_map = dict(field_map or {})
  report = report if report is not None else SkipReport()
  report.path, report.total, report.skipped = path, 0, []
  records = []
  for where, raw in _read_raw(path, report if on_error == "skip" else None):
    report.total += 1
    try:
      records.append(normalize_record(raw, fmt=fmt, field_map=field_map))
    except DataError as e:
      if on_error == "raise":
        raise DataError(e.reason, path=path, where=where, field=e.field) from None
      report.skipped.append((where, f"field {e.field!r}: {e.reason}" if e.field else e.reason))
  if report.total == 0:
    raise DataError("no records (empty file or empty array)", path=path)
  if report.skipped:
    logger.warning("%s", report.summary())
  if not records:
    raise DataError(f"every record was invalid:\n{report.summary()}", path=path)
  return records


def _open_text(path: str):
  if path.endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8")
  return open(path, encoding="utf-8")


def _read_raw(path: str, report: SkipReport | None) -> Iterator[tuple[str, Any]]:
  """Yields `(where, raw_record)`; `where` is "index i" (JSON array) or "line n" (JSONL)."""
  if not os.path.isfile(path):
    raise DataError("no such file", path=path)
  try:
    with _open_text(path) as f:
      text = f.read()
  except (OSError, UnicodeDecodeError, EOFError) as e:
    raise DataError(f"cannot read: {e}", path=path) from None
  stripped = text.lstrip()
  if not stripped:
    raise DataError("empty file", path=path)
  if stripped[0] == "[":
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise DataError(f"invalid JSON: {e.msg} (column {e.colno})", path=path, where=f"line {e.lineno}") from None
    for i, raw in enumerate(data):
      yield f"index {i}", raw
    return
  for lineno, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      raw = json.loads(line)
    except json.JSONDecodeError as e:
      if report is None:
        raise DataError(f"invalid JSON: {e.msg} (column {e.colno})", path=path, where=f"line {lineno}") from None
      report.total += 1
      report.skipped.append((f"line {lineno}", "invalid JSON"))
      continue
    yield f"line {lineno}", raw


def normalize_record(raw: Any, *, fmt: str = "auto", field_map: dict[str, str] | None = None) -> dict:
  """One raw record to `{"messages": [...]}`; raises `DataError` (with `.field`) if it is bad."""
  if not isinstance(raw, dict):
    raise DataError(f"expected a JSON object, got {type(raw).__name__}")
  fm = field_map or {}
  get = lambda d, key: d.get(fm.get(key, key))
  has = lambda d, key: fm.get(key, key) in d
  if fmt == "auto":
    fmt = next((name for name, keys in _SIGNATURES if all(has(raw, k) for k in keys)), None)
    if fmt is None:
      raise DataError(f"unknown record format: keys {sorted(raw)}; expected one of "
                      "messages, conversations, instruction+output, prompt+completion (or pass field_map)")
  fieldname = lambda key: fm.get(key, key)

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
    role = (roles or {r: r for r in ROLES}).get(role)
    if role is None:
      raise DataError(f"unknown role {turn.get(role_key)!r} (expected one of "
                      f"{sorted(roles or ROLES)})", field=f"{here}.{role_key}")
    if content is None:
      raise DataError("missing", field=f"{here}.{content_key}")
    if not isinstance(content, str):
      raise DataError(f"must be a string, got {type(content).__name__}", field=f"{here}.{content_key}")
    turns.append({"role": role, "content": content})
  return turns


def _check_conversation(messages: list[dict], *, fmt: str, fm: dict) -> None:
  if messages[-1]["role"] != "assistant":
    raise DataError(f"conversation must end with an assistant turn, ends with {messages[-1]['role']!r}",
                    field=_field_of(fmt, fm, len(messages) - 1, "role"))
  for i, m in enumerate(messages):
    if m["role"] == "assistant" and not m["content"].strip():
      raise DataError("empty assistant reply", field=_field_of(fmt, fm, i, "content"))


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
