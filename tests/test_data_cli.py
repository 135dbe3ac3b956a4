"""`python -m jaxsft.data stats` on real data."""

import re
import subprocess
import sys

import pytest

from jaxsft.data.__main__ import main


def test_stats_prints_histogram_and_modes(shared_data, capsys):
  assert main(["stats", "--data", str(shared_data / "oasst_top_paths.jsonl"), "--max-length", "512",
               "--buckets", "4", "--batch-size", "4"]) == 0
  out = capsys.readouterr().out
  assert "100 records" in out and "tokens per example" in out and "#" in out
  rows = {m.group(1): m.groups()[1:] for m in re.finditer(r"^(static|dynamic|bucketed|packed)\s+([\d,]+)\s+([\d,]+)\s+"
                                                             r"([\d.]+)\s+(\d+)\s+(\d+)$", out, re.M)}
  assert set(rows) == {"static", "dynamic", "bucketed", "packed"}
  padded = {mode: int(r[0].replace(",", "")) for mode, r in rows.items()}
  real = {int(r[1].replace(",", "")) for r in rows.values()}
  assert len(real) == 1  # every mode batches the same tokens
  assert padded["static"] > padded["dynamic"] > padded["bucketed"]
  assert int(rows["static"][3]) == 1 and int(rows["bucketed"][3]) <= 4
  boundaries = re.search(r"bucket boundaries: \[(.*)\]", out).group(1)
  assert boundaries.split(", ")[-1] == "512"


def test_stats_field_map_and_bad_file(shared_data, tmp_path, capsys):
  assert main(["stats", "--data", str(shared_data / "gsm8k_test.jsonl"), "--max-length", "256",
               "--field-map", '{"instruction": "question", "output": "answer"}']) == 0
  assert "1319 records" in capsys.readouterr().out
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a"}\n')
  assert main(["stats", "--data", str(bad)]) == 2
  err = capsys.readouterr().err
  assert str(bad) in err


@pytest.mark.slow
def test_module_entry_point(shared_data):
  done = subprocess.run([sys.executable, "-m", "jaxsft.data", "stats", "--data",
                         str(shared_data / "oasst_top_paths.jsonl"), "--max-length", "256"],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert "bucketed" in done.stdout
