"""A JSON array read element by element from a binary file, decoded as UTF-8 as it goes, so memory
is bounded by the largest element (records.py reads JSON-array data files with it).

Text that is not UTF-8 or not JSON raises `JsonTextError` with its line, the column in the
message; records.py turns it into a `DataError` naming the file.
"""

from __future__ import annotations

import codecs
import json
import sys
from typing import Any, Iterator

BOM = b"\xef\xbb\xbf"
CHUNK = 1 << 20  # characters read at a time


class JsonTextError(ValueError):
  """Text that is not UTF-8 or not JSON at `line` (1-based); `reason` names the column."""

  def __init__(self, reason: str, line: int):
    super().__init__(reason)
    self.reason, self.line = reason, line


def utf8_error(byte: int, column: int) -> str:
  return f"not valid UTF-8 (byte 0x{byte:02x} at column {column})"


class Utf8Reader:
  """`read(n)` of a binary file as text, decoded as it goes: a byte that is not UTF-8 raises
  `JsonTextError` naming its line and column (a text-mode file would name a chunk offset)."""

  def __init__(self, f):
    self.f = f
    self.decoder = codecs.getincrementaldecoder("utf-8")()
    self.line, self.column, self.start = 1, 0, True  # where the next character goes

  def read(self, n: int) -> str:
    data = self.f.read(n)
    if self.start and data.startswith(BOM):
      data = data[len(BOM):]
    self.start = False
    pending = self.decoder.getstate()[0]
    try:
      text = self.decoder.decode(data, final=not data)
    except UnicodeDecodeError as e:  # e.start counts from the bytes the decoder held back
      data = pending + data
      self._advance(data[:e.start].decode("utf-8"))
      raise JsonTextError(utf8_error(data[e.start], self.column + 1), self.line) from None
    self._advance(text)
    return text

  def _advance(self, text: str) -> None:
    newlines = text.count("\n")
    self.line += newlines
    self.column = len(text) - text.rfind("\n") - 1 if newlines else self.column + len(text)


class _Buffer:
  """The text being read: about `CHUNK` characters from `pos` on (more while one element is longer)."""

  def __init__(self, f):
    self.f, self.buf, self.pos, self.eof = f, "", 0, False
    # lines_before: newlines in the text dropped before buf; column_before: characters of buf's
    # first line that were dropped.
    self.lines_before, self.column_before = 0, 0

  def fill(self, min_more: int = 1) -> bool:
    if self.pos > CHUNK:  # drop what was consumed
      buf, pos = self.buf, self.pos
      newline = buf.rfind("\n", 0, pos)
      self.lines_before += buf.count("\n", 0, pos)
      self.column_before = pos - newline - 1 if newline >= 0 else self.column_before + pos
      self.buf, self.pos = buf[pos:], 0
    added = 0
    while not self.eof and added < min_more:
      chunk = self.f.read(max(CHUNK, min_more))
      self.eof = not chunk
      self.buf += chunk
      added += len(chunk)
    return added > 0

  def skip_ws(self) -> str | None:
    """The next character that is not whitespace (`pos` moved to it); None at the end."""
    while True:
      while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
        self.pos += 1
      if self.pos < len(self.buf):
        return self.buf[self.pos]
      if not self.fill():
        return None

  def fail(self, message: str, at: int):
    line = self.lines_before + self.buf.count("\n", 0, at) + 1
    newline = self.buf.rfind("\n", 0, at)
    column = at - newline if newline >= 0 else self.column_before + at + 1
    raise JsonTextError(f"invalid JSON: {message} (column {column})", line)

  def decode(self, decoder: json.JSONDecoder) -> Any:
    """The JSON value at `pos` (`pos` moved past it), reading on while it is cut off."""
    need = 0
    while True:
      try:
        raw, self.pos = decoder.raw_decode(self.buf, self.pos)
        return raw
      except RecursionError:
        self.fail(f"nested deeper than Python's recursion limit ({sys.getrecursionlimit()})", self.pos)
      except json.JSONDecodeError as e:
        # A cut-off element fails near the buffer's end (a literal or number cut short) or in an
        # unterminated string; anything else is bad JSON whatever follows.
        incomplete = e.pos >= len(self.buf) - 64 or e.msg.startswith("Unterminated string")
        if self.eof or not incomplete:
          self.fail(e.msg, e.pos)
        need = max(2 * need, CHUNK)
        self.fill(need)


def read_json_array(f) -> Iterator[tuple[str, Any]]:
  """`("index i", element)` for each element of the JSON array that `f.read(n)` gives as text
  (a `Utf8Reader`), decoded one at a time."""
  text, decoder = _Buffer(f), json.JSONDecoder()
  text.fill()
  text.skip_ws()
  text.pos += 1  # the "["
  index = 0
  if text.skip_ws() == "]":
    text.pos += 1
  else:
    while True:
      if text.skip_ws() is None:
        text.fail("Expecting value", text.pos)
      yield f"index {index}", text.decode(decoder)
      index += 1
      sep = text.skip_ws()
      if sep == ",":
        text.pos += 1
        continue
      if sep == "]":
        text.pos += 1
        break
      text.fail("Expecting ',' delimiter", text.pos)
  if text.skip_ws() is not None:
    text.fail("Extra data", text.pos)
