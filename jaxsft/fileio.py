"""Writing files so that a reader (or a crash) never sees half of one."""

from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Callable, IO


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = False) -> pathlib.Path:
  """`write(f)` into a temp file beside `path`, fsync, then rename over `path`.

  The rename is atomic on POSIX: `path` holds either the old content or all of the new.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise
  return path
