"""An output folder on a read-only file system, or on one whose free space runs out mid-write,
for the export and the token-store build: one `error:` line naming the failure and the path,
exit 2, and nothing partial left (no temporary folder, no half an export or store).

Real file systems: a tmpfs mounted read-only, or small enough to fill up. Mounting needs the
privilege to (root in a container that allows it); without it the tests are skipped, saying why.
"""

import contextlib
import pathlib
import subprocess

import pytest

from test_faults import only_error_line, tiny_run  # noqa: F401 (a fixture)


@contextlib.contextmanager
def mounted_tmpfs(folder: pathlib.Path, options: str):
  folder.mkdir(parents=True)
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True)
  if mounted.returncode:
    pytest.skip(f"cannot mount a file system here: {mounted.stderr.strip()}")
  try:
    yield folder
  finally:
    subprocess.run(["umount", "--lazy", str(folder)], check=False)


def assert_one_error_line(r, message: str, folder: pathlib.Path) -> None:
  """Exit 2 and one `error:` line naming the failure and the folder written."""
  assert r.returncode == 2, r.stderr[-3000:]
  line = only_error_line(r.stderr)
  assert message in line and str(folder) in line, line


def everything_under(folder: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_export_to_a_read_only_file_system_is_one_error_line(tiny_run, tmp_path, run_cli):  # noqa: F811
  from jaxsft import export

  with mounted_tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
    r = run_cli(export.main, [tiny_run["run"], "--out", ro / "export"])
    assert_one_error_line(r, "Read-only file system", ro)
    assert everything_under(ro) == []


def test_export_that_fills_the_disk_is_one_error_line_and_leaves_nothing(tiny_run, tmp_path, run_cli):  # noqa: F811
  """The tiny model's merged export is ~13 MB: a 2 MB file system fills up partway through it."""
  from jaxsft import export

  with mounted_tmpfs(tmp_path / "small", "size=2m") as small:
    r = run_cli(export.main, [tiny_run["run"], "--out", small / "export"])
    assert_one_error_line(r, "No space left on device", small)
    assert everything_under(small) == []  # no half export, no temporary folder


def build_args(data, cache):
  return ["build", "--data", data, "--model", "smollm2-135m-instruct", "--max-length", "256", "--cache-dir", cache]


def test_token_store_on_a_read_only_file_system_is_one_error_line(small_data, tmp_path, run_cli):
  from jaxsft.data.__main__ import main

  with mounted_tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
    r = run_cli(main, build_args(small_data, ro / "tokens"))
    assert_one_error_line(r, "Read-only file system", ro)
    assert everything_under(ro) == []


def test_token_store_that_fills_the_disk_is_one_error_line_and_leaves_nothing(small_data, tmp_path, run_cli):
  """160 records of up to 256 tokens: the store's token arrays need more than the 16 KB there are."""
  from jaxsft.data.__main__ import main

  with mounted_tmpfs(tmp_path / "small", "size=16k") as small:
    r = run_cli(main, build_args(small_data, small / "tokens"))
    assert_one_error_line(r, "No space left on device", small)
    assert everything_under(small) in ([], ["tokens"]), everything_under(small)  # at most the empty cache folder
    # with room, the same build succeeds: the failure left nothing in its way
  with mounted_tmpfs(tmp_path / "large", "size=8m") as large:
    r = run_cli(main, build_args(small_data, large / "tokens"))
    assert r.returncode == 0, r.stderr[-3000:]
