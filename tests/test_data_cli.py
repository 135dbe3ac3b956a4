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
  rows = {m.group(1): m.groups()[1:] for m in re.finditer(
      r"^(static|dynamic|bucketed|packed|bucketed_packed)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)\s+(\d+)\s+(\d+)"
      r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
  assert set(rows) == {"static", "dynamic", "bucketed", "packed", "bucketed_packed"}
  for r in rows.values():  # predicted seconds: steps + compiles = total
    assert float(r[5]) > 0 and float(r[6]) > 0 and abs(float(r[5]) + float(r[6]) - float(r[7])) < 0.15
  assert "cost default: " in out and "batching: auto would choose" in out
  predicted = {mode: float(r[7]) for mode, r in rows.items()}
  assert predicted["dynamic"] > predicted["bucketed"]  # dynamic pads more, and compiles a width per few batches
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


def test_stats_where_max_length_cuts_every_reply_shows_the_lengths_then_one_error(shared_data, tmp_path, capsys):
  data = shared_data / "alpaca_en_demo.json"
  assert main(["stats", "--data", str(data), "--max-length", "8", "--cache-dir", str(tmp_path)]) == 2
  captured = capsys.readouterr()
  assert "max_length 8: 999 truncated, 999 dropped" in captured.out
  bins = re.findall(r"^\s+(\d+)-(\d+)\s", captured.out, re.M)
  assert [(int(lo), int(hi)) for lo, hi in bins] == [(n, n) for n in range(1, 9)]  # one token wide, each once
  assert captured.err.strip() == (f"error: {data}: the records: all 999 are cut at max_length 8 before their reply "
                                  "starts, so none has a token to train on (the shortest is 48 tokens whole); "
                                  "raise --max-length")


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


def test_stats_without_the_store_counts_the_skipped_records(tmp_path, capsys):
  data = tmp_path / "d.jsonl"
  data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": ""}\n{"prompt": "c"}\n')
  for cache in (["--no-cache"], ["--cache-dir", str(tmp_path / "cache")]):  # from the records, and from a store
    assert main(["stats", "--data", str(data), "--max-length", "64", *cache]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"{data}: 1 records (2 skipped)") and lines[1].startswith("  1 x field 'completion'")
    assert "  first: line 2: " in out and "  first: line 3: field 'completion': missing" in out


# ChatML, plus a note after any turn that contains "zzz": the reply span of such a turn cannot be located.
NOTE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% if 'zzz' in m['content'] %}(note)\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def note_model(tokenizer, tmp_path):
  """A tokenizer folder with NOTE_TEMPLATE, and data whose record on line 5 it cannot label."""
  import copy

  tok = copy.deepcopy(tokenizer)
  tok.chat_template = NOTE_TEMPLATE
  tok.save_pretrained(str(tmp_path / "tok"))
  (tmp_path / "tok" / "config.json").write_text('{"model_type": "llama"}')
  data = tmp_path / "d.jsonl"
  data.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a"}\n{"prompt": "a", "completion": "c"}\n'
                  '{"prompt": "q", "completion": "zzz"}\n')
  return tmp_path / "tok", data


@pytest.mark.parametrize("command", ["build", "stats", "stats --no-cache"])
def test_a_record_the_template_cannot_label_is_an_error_or_a_skip(note_model, tmp_path, capsys, command):
  tok, data = note_model
  run = lambda path, on_error: main([*command.split(), "--data", str(path), "--model", str(tok), "--max-length", "64",
                                     "--cache-dir", str(tmp_path / "cache"), "--on-error", on_error])
  data_without_line_3 = tmp_path / "d2.jsonl"
  data_without_line_3.write_text(data.read_text().replace('{"prompt": "a"}\n', "\n"))
  assert run(data, "raise") == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: {data}: line 3: field 'completion': missing") and err.count("\n") == 1
  assert err.endswith("; --on-error skip leaves such records out, counted and reported\n"), err
  assert run(data_without_line_3, "raise") == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: {data_without_line_3}: line 5: assistant turn 1: the chat template renders")
  assert err.count("\n") == 1  # one line, no traceback
  assert run(data, "skip") == 0
  out = capsys.readouterr().out
  if command == "build":
    assert "2 of 4 records skipped as invalid" in out and "cannot locate the reply span" in out
  else:
    assert f"{data}: 2 records (2 skipped)" in out


def test_the_trainer_reports_a_record_the_template_cannot_label_in_one_line(note_model, tmp_path, train_main):
  tok, data = note_model
  data.write_text(data.read_text().replace('{"prompt": "a"}\n', "\n"))
  done = train_main(["--model", tok, "--data", data, "--output-dir", tmp_path / "run",
                     f"data.cache_dir={tmp_path / 'cache'}", "--no-progress"])
  assert done.returncode == 2, done.stderr
  assert f"error: {data}: line 5: assistant turn 1: the chat template renders" in done.stderr
  assert "; data.on_error=skip leaves such records out, counted and reported" in done.stderr
  assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("cache", [True, False])
def test_the_trainer_skips_a_record_the_template_cannot_label(note_model, tmp_path, cache):
  from jaxsft import config as config_lib
  from jaxsft.train.data_plan import load_file

  tok, data = note_model
  cfg = config_lib.TrainConfig()
  cfg.model.name = str(tok)
  cfg.data.on_error, cfg.data.cache, cfg.data.cache_dir = "skip", cache, str(tmp_path / "cache")
  records = load_file(str(data), cfg)
  assert [r["messages"][-1]["content"] for r in records] == ["b", "c"]  # line 3 (no completion), line 5 (zzz) left out


@pytest.mark.slow
def test_module_entry_point(shared_data):
  done = subprocess.run([sys.executable, "-m", "jaxsft.data", "stats", "--data",
                         str(shared_data / "oasst_top_paths.jsonl"), "--max-length", "256", "--no-cache"],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert "bucketed" in done.stdout
