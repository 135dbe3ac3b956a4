"""A writer that dies at a chosen point, for the fault-injection tests (run as a script).

    python tests/crash_writer.py KIND FOLDER N [ARGS...]

Every call that publishes or removes something on disk (os.replace, os.rename, the atomic
exchange of jaxsft.io, shutil.rmtree, os.unlink) is counted once the write under test starts; the
N-th ends the process with os._exit(CRASHED) before it happens, as a kill -9 at that moment would
(nothing after it runs: no finally, no atexit). With N past the last point the write completes and
the exit status is 0; the test raises N until then, so every point is hit once.

KIND: `adapter` (RunFiles.save_adapter's swap with lora.save_adapter's files), `checkpoint` (the
second of two orbax saves of Checkpoints) and `export` (python -m jaxsft.export --overwrite).
"""

import os
import pathlib
import shutil
import sys

CRASHED = 86


class CrashAt:
  """Counts the hooked calls (a call made inside another, e.g. rmtree's unlinks, is part of it)."""

  def __init__(self, n: int):
    self.n, self.count, self.armed, self.points, self.depth = n, 0, False, [], 0

  def wrap(self, owner, name: str):
    real = getattr(owner, name)

    def hooked(*args, **kwargs):
      if self.armed and not self.depth:
        self.count += 1
        self.points.append(f"{name}({', '.join(os.path.basename(str(a)) for a in args[:2])})")
        if self.count == self.n:
          sys.stderr.write(f"crash_writer: dying before {self.points[-1]} (point {self.n})\n")
          sys.stderr.flush()
          os._exit(CRASHED)
      self.depth += 1
      try:
        return real(*args, **kwargs)
      finally:
        self.depth -= 1

    setattr(owner, name, hooked)


def main(kind: str, folder: str, n: str, *args: str) -> int:
  from jaxsft import io as jaxsft_io

  crash = CrashAt(int(n))
  if os.environ.get("CRASH_WRITER_NO_EXCHANGE"):  # as on a file system without RENAME_EXCHANGE
    jaxsft_io._exchange = lambda a, b: False
  for owner, name in ((os, "replace"), (os, "rename"), (os, "unlink"), (shutil, "rmtree"), (jaxsft_io, "_exchange")):
    crash.wrap(owner, name)
  folder = pathlib.Path(folder)
  if kind == "adapter":
    write_adapter(folder, args[0], crash)
  elif kind == "checkpoint":
    write_checkpoints(folder, crash)
  elif kind == "export":
    from jaxsft import export

    crash.armed = True
    code = export.main([*args, str(folder)])  # ARGS end with --out
    if code:
      return code
  else:
    raise SystemExit(f"unknown kind {kind!r}")
  print(f"crash_writer: completed after {crash.count} points: {crash.points}", file=sys.stderr)
  return 0


def write_adapter(run: pathlib.Path, version: str, crash: CrashAt) -> None:
  """RUN/adapter replaced by RunFiles' swap; its files written as lora.save_adapter writes them
  (each atomically), their content tagged with `version` so a reader can tell old from new."""
  from jaxsft import io as jaxsft_io

  def fill(tmp: pathlib.Path):
    jaxsft_io.write_json(tmp / "adapter_config.json", {"peft_type": "LORA", "version": version})
    jaxsft_io.atomic_write(tmp / "adapter_model.safetensors", lambda f: f.write(version.encode() * 1000), binary=True)

  crash.armed = True
  jaxsft_io.replace_directory(run / "adapter", fill)


def write_checkpoints(run: pathlib.Path, crash: CrashAt) -> None:
  """Two saves of a small RunState (step 1, then step 2 with other values); the crash is armed
  for the second only."""
  import jax.numpy as jnp

  from jaxsft import run_files
  from jaxsft.train.checkpoints import Checkpoints
  from jaxsft.train.state import RunState

  checkpoints = Checkpoints(run_files.RunFiles(run), keep=2)
  for step in (1, 2):
    state = RunState(trainable={"a": jnp.full((4, 3), float(step))}, opt_state={"m": jnp.full((3,), -float(step))},
                     step=step, data_state={"position": step}, epoch_nll=float(step))
    crash.armed = step == 2
    checkpoints.save(state)
    checkpoints.manager.wait_until_finished()
  crash.armed = False
  checkpoints.close()


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
