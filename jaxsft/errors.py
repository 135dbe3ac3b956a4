"""Refusals and the one way a jaxsft command turns them into an exit status.

A refusal is an input or environment jaxsft cannot work with (a bad config key, a malformed
record, an unsupported model, a full disk): the command prints one line, `error: <reason>`, on
stderr and exits with `EXIT_USAGE`. Anything else is a bug and keeps its traceback.

Every refusal class derives from `JaxsftError`; each keeps the builtin base it had before
(`ValueError`, `RuntimeError`), so a caller catching that still catches it.
"""

from __future__ import annotations

import errno
import os
import re
import select
import stat
import sys
from typing import Callable

EXIT_USAGE = 2
"""The exit status of a refusal (argparse's, for a bad command line, is the same)."""
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
"""stdout's reader went away (`... | head`): 128 + SIGPIPE, what a shell tool killed by it returns."""

# OSErrors that say something about the machine or the user's paths, not about jaxsft.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS,
                                errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG,
                                errno.EMFILE})
# Libraries that raise their own error type for a failed write keep the OS error number only in
# the text: tensorstore (orbax's checkpoints) ends with "No space left on device
# [os_error_code='28']", Rust's std::io::Error (safetensors, tokenizers) with "(os error 28)".
_ERRNO_IN_TEXT = re.compile(r"\[os_error_code='(\d+)'\]|\(os error (\d+)\)")
_PATH_IN_TEXT = re.compile(r'Failed (?:writing|reading): "([^"]+)"')


class JaxsftError(Exception):
  """Base of every refusal: the message is the whole story (file, line or key, and the fix)."""


class ConfigError(JaxsftError, ValueError):
  """A bad configuration key or value (names the key and, for YAML, the file). Checks that need
  a fact known only at run time (the devices, the model's parameters, the run directory) raise it
  too, naming the key the same way."""


class ModelError(JaxsftError, ValueError):
  """A model jaxsft cannot load: an unsupported architecture or a malformed config or weights file."""


class ModelNotFoundError(JaxsftError, FileNotFoundError):
  """A model jaxsft cannot find: no such folder or file, a package that ships it not installed, a
  hub id neither in the local Hugging Face cache nor reachable, or a folder without the weights
  jaxsft reads."""


class _OSErrorInText(OSError):
  """An OS error read from another error's text; `carrier` names that error's type."""

  carrier = ""


def one_line(text: str) -> str:
  """A library's message made to fit the `error:` line (pyarrow's and PyYAML's span lines)."""
  return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def environment_failure(error: BaseException) -> OSError | None:
  """The OSError behind `error` (itself, or along its cause/context chain) when it is an
  environment failure (disk full, permission, missing path); None otherwise. A library error
  that names the OS error only in its text (see `_ERRNO_IN_TEXT`) counts as that OSError."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in ENVIRONMENT_ERRNOS:
      return error
    if not isinstance(error, OSError):
      found = _ERRNO_IN_TEXT.search(str(error))
      code = int(next(g for g in found.groups() if g)) if found else None
      if code in ENVIRONMENT_ERRNOS:
        path = _PATH_IN_TEXT.search(str(error))
        failure = _OSErrorInText(code, os.strerror(code), path.group(1) if path else None)
        failure.carrier = type(error).__name__
        return failure
    error = error.__cause__ or error.__context__
  return None


def refusal_message(error: BaseException) -> str | None:
  """The `error:` line's text for a refusal; None for a bug (which keeps its traceback)."""
  if isinstance(error, JaxsftError):
    return str(error)
  if isinstance(error, RecursionError):
    return f"input nested too deeply to read ({error})"
  failure = environment_failure(error)
  if failure is not None:
    reason = failure.strerror or str(failure)
    where = f": {failure.filename}" if failure.filename else ""
    if failure is error:
      context = ""
    elif isinstance(failure, _OSErrorInText):  # the library's own text repeats the path and the reason
      context = f" ({failure.carrier})"
    else:
      context = f" ({type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]})"
    return f"{reason}{where}{context}"
  return None


def stdout_reader_gone() -> bool:
  """Whether stdout is a pipe whose reading end is closed (a `| head` that has exited): the
  kernel flags such a pipe with POLLERR. A broken pipe anywhere else is not this."""
  try:
    fd = sys.stdout.fileno()
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
      return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))
  except (OSError, ValueError, AttributeError):  # no real stdout (closed, captured, replaced)
    return False


def run_cli(body: Callable[[], int | None]) -> int:
  """Runs a command's body: its return value is the exit status (None: 0); a refusal is one
  `error:` line on stderr and `EXIT_USAGE`; Ctrl-C is `EXIT_INTERRUPTED`; stdout's reader gone
  (`| head`) is a quiet `EXIT_BROKEN_PIPE`; a bug propagates."""
  try:
    status = body()
  except KeyboardInterrupt:
    return EXIT_INTERRUPTED
  except Exception as e:
    if isinstance(e, BrokenPipeError) and stdout_reader_gone():
      # What is left in stdout's buffer would raise again at the interpreter's exit: point the
      # descriptor at /dev/null so that last flush goes nowhere.
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
      return EXIT_BROKEN_PIPE
    message = refusal_message(e)
    if message is None:
      raise
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE
  return 0 if status is None else int(status)
