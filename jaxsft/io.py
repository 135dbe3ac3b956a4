"""The one way jaxsft writes a file or a folder, so that a reader (or a crash) never sees half of it.

- `atomic_path` / `atomic_write` / `write_text` / `write_json`: a file written to a temp beside
  the target, fsynced and renamed over it.
- `replace_directory` / `remove_directory`: a folder filled beside the target and swapped in
  whole, or moved aside whole before it is deleted.
- A temp's name carries its writer (`.<name>.<host>-<pid>.<random>.tmp`, `TEMP_NAME`), so
  `remove_leftovers` can delete those of dead writers.
- `jaxsft_cache`: the root of jaxsft's cache (token stores, model copies, compile calibrations).

A leaf module (no jaxsft imports): the model, adapter, data and run-directory code all write
through it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import socket
import tempfile
from typing import IO, Callable, Iterator

log = logging.getLogger("jaxsft.io")


def jaxsft_cache() -> pathlib.Path:
  """$JAXSFT_CACHE, by default ~/.cache/jaxsft."""
  return pathlib.Path(os.environ.get("JAXSFT_CACHE", pathlib.Path.home() / ".cache" / "jaxsft"))


def rename_over(source: str | os.PathLike, target: str | os.PathLike) -> None:
  """Gives `source` the name `target`, replacing a file or empty folder that had it, in one atomic
  step (POSIX rename): a reader of `target` finds the old one or the new one, never neither.
  Every name jaxsft replaces is replaced here, so that guarantee lives in one place."""
  os.replace(source, target)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[pathlib.Path]:
  """A temp path beside `path` to write; on success it is fsynced and renamed over `path`.

  The rename is atomic on POSIX: `path` holds either the old content or all of the new. On an
  exception the temp file is removed and `path` is untouched.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
  os.close(fd)
  tmp = pathlib.Path(tmp)
  try:
    yield tmp
    tmp.chmod(default_mode(directory=False))  # after the writer: some (safetensors) replace the temp with a private one
    with open(tmp, "rb") as f:
      os.fsync(f.fileno())
    rename_over(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = False) -> pathlib.Path:
  """`write(f)` to an open file that replaces `path` atomically once `write` returns."""
  with atomic_path(path) as tmp:
    with open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
      write(f)
  return pathlib.Path(path)


def write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
  return atomic_write(path, lambda f: f.write(text))


def write_json(path: str | os.PathLike, obj) -> pathlib.Path:
  return write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


@contextlib.contextmanager
def naming_the_target(target: str | os.PathLike) -> Iterator[None]:
  """A write into `target` that fails for the machine (a full disk, a read-only file system)
  names `target` when the error itself names no path: safetensors' and numpy's writers say only
  "No space left on device". A failure that names its path, and any other error, is left as it is."""
  from jaxsft import errors

  try:
    yield
  except Exception as e:
    failure = errors.environment_failure(e)
    if failure is None or failure.filename:
      raise
    raise OSError(failure.errno, failure.strerror or os.strerror(failure.errno), os.fspath(target)) from e


def replace_directory(target: str | os.PathLike, fill: Callable[[pathlib.Path], None]) -> pathlib.Path:
  """`fill(tmp_dir)` into a fresh folder beside `target`, then swap it in for `target`.

  The swap is one atomic exchange of the two names (Linux `renameat2(RENAME_EXCHANGE)`), so at
  every instant `target` is the whole old folder or the whole new one, and a crash leaves at most
  a hidden temp beside it (removed by the next writer, `remove_leftovers`). Where the exchange is
  unavailable (another OS or file system) it is two renames, old out of the way then new in; a
  crash between them leaves `target` missing and the old folder as `.<name>.*.old`, which
  `remove_leftovers` puts back. A failed `fill` leaves `target` as it was. Writers of one target
  may race (two processes caching the same model): each swap is whole, and the last one stays.
  """
  target = pathlib.Path(target)
  target.parent.mkdir(parents=True, exist_ok=True)
  remove_leftovers(target)
  tmp = make_temp_directory(target)
  old = tmp.with_suffix(".old")
  try:
    fill(tmp)
    _give_default_modes(tmp)
    _fsync_tree(tmp)
    if not _rename_unless_taken(tmp, target) and not _exchange(tmp, target):  # now `tmp` holds the old folder
      rename_over(target, old)
      rename_over(tmp, target)
    _fsync_dir(target.parent)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
  return target


def _rename_unless_taken(tmp: pathlib.Path, target: pathlib.Path) -> bool:
  """Renames the folder `tmp` to `target` where nothing but an empty folder has that name; False
  where something does (another writer of the same target may have published it since any check)."""
  try:
    os.rename(tmp, target)
  except OSError as e:
    if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
      return False
    raise
  return True


def remove_directory(target: str | os.PathLike) -> None:
  """Removes `target` whole for a reader: renamed away first (one atomic step), then deleted; a
  crash mid-delete leaves a hidden temp that `remove_leftovers` removes."""
  target = pathlib.Path(target)
  if not target.exists():
    return
  aside = pathlib.Path(tempfile.mkdtemp(prefix=temp_prefix(target), suffix=".tmp", dir=target.parent))
  rename_over(target, aside)  # over the fresh empty folder: atomic
  shutil.rmtree(aside, ignore_errors=True)


def make_temp_directory(target: pathlib.Path) -> pathlib.Path:
  """A fresh, empty folder beside `target`, to be filled and renamed to it, with the mode a plain
  `mkdir` would give it (`default_mode`)."""
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=temp_prefix(target), suffix=".tmp", dir=target.parent))
  tmp.chmod(default_mode(directory=True))
  return tmp


def default_mode(*, directory: bool) -> int:
  """The mode `open(path, "w")` or `mkdir` would give a new file or folder: 0o666 or 0o777 less the
  process's umask. `tempfile` makes its temps private (0o600, 0o700) whatever the umask; a file
  renamed from a temp keeps that mode, so an exported model or a shared cache would be unreadable
  by the other users a plain write lets read it."""
  return (0o777 if directory else 0o666) & ~_umask()


def _umask() -> int:
  """The process's umask, read from /proc where Linux shows it; elsewhere set and put back
  (`os.umask` has no read-only form)."""
  try:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
      if line.startswith("Umask:"):
        return int(line.split()[1], 8)
  except OSError:
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def temp_prefix(target: pathlib.Path) -> str:
  return f".{target.name}.{_host()}-{os.getpid()}."


def _host() -> str:
  return socket.gethostname().replace(".", "_")


# The name `temp_prefix` starts: the target's name, then its writer's host and pid (`remove_leftovers`).
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<host>[^.]*)-(?P<pid>\d+)\.[^.]+\.(?P<kind>tmp|old)$")


def _alive(host: str, pid: int) -> bool:
  """Whether process `pid` of `host` may still run (a process of another host: assumed so)."""
  if host != _host():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_leftovers(target: str | os.PathLike) -> list[pathlib.Path]:
  """Removes what writers of `target` that died mid-write left beside it (temp files and folders
  named by `atomic_path` / `replace_directory`); a live writer's temps are kept. When `target`
  is missing and a dead writer's `.old` copy is there (a crash between the two renames of the
  fallback swap), that copy is put back as `target`. Returns what was removed or restored."""
  target = pathlib.Path(target)
  if not target.parent.is_dir():
    return []
  done = []
  for path in sorted(target.parent.iterdir()):
    match = TEMP_NAME.match(path.name)
    if not match or match["name"] != target.name or _alive(match["host"], int(match["pid"])):
      continue
    if match["kind"] == "old" and not target.exists():
      rename_over(path, target)
      log.warning("restored %s from %s (left by a writer that stopped mid-swap)", target, path.name)
    elif path.is_dir() and not path.is_symlink():
      shutil.rmtree(path, ignore_errors=True)
    else:
      path.unlink(missing_ok=True)
    done.append(path)
  return done


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
  """Atomically swaps the names `a` and `b` (both must exist); False where the OS or the file
  system cannot (the caller falls back to two renames)."""
  renameat2 = getattr(_libc(), "renameat2", None)
  if renameat2 is None:
    return False
  at_fdcwd, rename_exchange = -100, 2
  if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
    return False
  raise OSError(err, os.strerror(err), str(b))


_LIBC = []


def _libc():
  if not _LIBC:
    try:
      _LIBC.append(ctypes.CDLL(None, use_errno=True))
    except OSError:
      _LIBC.append(None)
  return _LIBC[0]


def _fsync_dir(folder: pathlib.Path) -> None:
  fd = os.open(folder, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _give_default_modes(folder: pathlib.Path) -> None:
  """Every file and folder under `folder` gets `default_mode`: a library that writes through a
  temp of its own (safetensors) leaves its file private."""
  for path in folder.rglob("*"):
    if not path.is_symlink():
      path.chmod(default_mode(directory=path.is_dir()))


def _fsync_tree(folder: pathlib.Path) -> None:
  """Every file under `folder` on disk before the swap publishes it (a crash after the swap
  must not find the new folder's files empty)."""
  for path in folder.rglob("*"):
    if path.is_file() and not path.is_symlink():
      with open(path, "rb") as f:
        os.fsync(f.fileno())
  _fsync_dir(folder)
