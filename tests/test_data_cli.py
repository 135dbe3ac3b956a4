"""`python -m jaxsft.data stats` and `build` on real data (token stores in a temp folder)."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from jaxsft.data.__main__ import main


def test_stats_prints_histogram_and_modes(shared_data, capsys, tmp_path):
  assert main(["stats", "--data", str(shared_data / "oasst_top_paths.jsonl"), "--max-length", "512",
               "--buckets", "4", "--batch-size", "4", "--cache-dir", str(tmp_path)]) == 0
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
               "--field-map", '{"instruction": "question", "output": "answer"}', "--cache-dir", str(tmp_path)]) == 0
  assert "1319 records" in capsys.readouterr().out
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a"}\n')
  assert main(["stats", "--data", str(bad), "--cache-dir", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert str(bad) in err


def test_build_then_find_then_stats_from_the_store(shared_data, tmp_path, capsys):
  data = tmp_path / "chat.jsonl"  # two bad records among the real ones
  rows = [json.loads(l) for l in (shared_data / "oasst_top_paths.jsonl").read_text().splitlines()]
  rows[3] = {"messages": [{"role": "user", "content": "no reply"}]}
  rows[7] = {"prompt": "p", "completion": ""}
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  args = ["--data", str(data), "--max-length", "64", "--cache-dir", str(tmp_path / "cache"), "--on-error", "skip"]
  assert main(["build", *args[:-2]]) == 2  # build's default is the trainer's: a bad record is an error
  assert "line 4" in capsys.readouterr().err
  assert main(["build", *args]) == 0
  out = capsys.readouterr().out
  folder = re.search(r"token store: (\S+) \(built in [\d.]+s\)", out).group(1)
  assert pathlib.Path(folder).parent == tmp_path / "cache" and (pathlib.Path(folder) / "manifest.json").is_file()
  kept, dropped = map(int, re.search(r"(\d+) examples .* from 98 records; (\d+) dropped", out).groups())
  assert kept + dropped == 98 and dropped > 0  # 64 tokens leave some conversations without a reply token
  assert "2 of 100 records skipped as invalid" in out and "empty assistant reply" in out
  assert main(["build", *args]) == 0
  assert f"token store: {folder} (found in" in capsys.readouterr().out
  assert main(["stats", *args]) == 0
  assert f"{dropped} dropped" in capsys.readouterr().out
  assert [p.name for p in (tmp_path / "cache").iterdir()] == [pathlib.Path(folder).name]  # stats reused it


@pytest.mark.slow
def test_module_entry_point(shared_data):
  done = subprocess.run([sys.executable, "-m", "jaxsft.data", "stats", "--data",
                         str(shared_data / "oasst_top_paths.jsonl"), "--max-length", "256", "--no-cache"],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert "bucketed" in done.stdout
