"""load_records: formats, normalization, and DataError / skip reporting on bad input."""

import gzip
import json
import logging
import pickle

import pytest

from jaxsft.data import DataError, Record, SkipReport, load_records


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_alpaca_file_input_appended(shared_data):
  raw = json.loads((shared_data / "alpaca_en_demo.json").read_text())
  report = SkipReport()
  records = load_records(shared_data / "alpaca_en_demo.json", report=report)
  assert type(records) is list and len(records) == len(raw) == 999
  assert report.num_skipped == 0 and report.total == 999 and report.path.endswith("alpaca_en_demo.json")
  with_input = next(i for i, r in enumerate(raw) if r["input"])
  user, reply = records[with_input]["messages"]
  assert user == {"role": "user", "content": raw[with_input]["instruction"] + "\n\n" + raw[with_input]["input"]}
  assert reply == {"role": "assistant", "content": raw[with_input]["output"]}
  without = next(i for i, r in enumerate(raw) if not r["input"])
  assert records[without]["messages"][0]["content"] == raw[without]["instruction"]


def test_messages_files(shared_data):
  chat = load_records(shared_data / "chat_multiturn_demo.json")
  assert len(chat) == 300 and max(len(r["messages"]) for r in chat) == 12
  oasst = load_records(shared_data / "oasst_top_paths.jsonl")
  assert len(oasst) == 100
  for r in list(chat) + list(oasst):
    assert r["messages"][-1]["role"] == "assistant"
    assert set(r) == {"messages"}  # extra fields (label) are not carried


def test_field_map_gsm8k(shared_data):
  with pytest.raises(DataError, match="unknown record format"):
    load_records(shared_data / "gsm8k_test.jsonl")
  records = load_records(shared_data / "gsm8k_test.jsonl", field_map={"instruction": "question", "output": "answer"})
  assert len(records) == 1319
  assert records[0]["messages"][1]["content"].endswith("#### 18")


def test_sharegpt_prompt_completion_gz(tmp_path):
  rows = [{"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                             {"from": "gpt", "value": "A"}]},
          {"prompt": "P", "completion": "C"},
          {"prompt": [{"role": "user", "content": "P2"}], "completion": [{"role": "assistant", "content": "C2"}]},
          {"question": "Q3", "response": "R3"}]
  path = tmp_path / "mixed.jsonl.gz"
  with gzip.open(path, "wt") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows[:3])
  records = load_records(path)
  assert [m["role"] for m in records[0]["messages"]] == ["system", "user", "assistant"]
  assert records[1]["messages"] == [{"role": "user", "content": "P"}, {"role": "assistant", "content": "C"}]
  assert records[2]["messages"][1]["content"] == "C2"
  mapped = load_records(write_jsonl(tmp_path / "m.jsonl", rows[3:]), fmt="alpaca",
                        field_map={"instruction": "question", "output": "response"})
  assert mapped[0]["messages"][1]["content"] == "R3"


BAD = [
    # (file name, file text, text the DataError must contain: where, field)
    ("array_invalid.json", '[{"instruction": "a", "output": "b"},\n {"instruction": "c" "output": "d"}]',
     ["line 2", "invalid JSON"]),
    ("lines_invalid.jsonl", '{"prompt": "a", "completion": "b"}\n{"prompt": "a", completion: 1}\n',
     ["line 2", "invalid JSON"]),
    ("missing.json", json.dumps([{"instruction": "a", "output": "b"}, {"instruction": "a", "outptu": "b"}]),
     ["index 1", "field 'output': missing", "Alpaca record"]),
    ("unknown.json", json.dumps([{"question": "a", "answer": "b"}]), ["index 0", "unknown record format"]),
    ("plain_text.jsonl", json.dumps({"text": "Once upon a time"}), ["line 1", "field 'text'", "plain text",
                                                                    "prompt and a completion"]),
    ("missing_content.jsonl", json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}),
     ["line 1", "'messages[0].content'", "missing"]),
    ("nonstring.json", json.dumps([{"instruction": "a", "input": 3, "output": "b"}]),
     ["index 0", "'input'", "must be a string"]),
    ("empty_reply.jsonl", "\n".join(json.dumps(r) for r in [
        {"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "  "}]),
     ["line 3", "'completion'", "empty assistant reply"]),
    ("not_last.json", json.dumps([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                                {"role": "user", "content": "c"}]}]),
     ["index 0", "'messages[2].role'", "must end with an assistant turn"]),
    ("bad_role.json", json.dumps([{"conversations": [{"from": "robot", "value": "a"}, {"from": "gpt", "value": "b"}]}]),
     ["index 0", "'conversations[0].from'", "unknown role 'robot'"]),
    ("empty.json", "  \n", ["empty file"]),
    ("empty_array.json", "[]", ["no records"]),
]


@pytest.mark.parametrize("name,text,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_file_position_field(tmp_path, name, text, expected):
  path = tmp_path / name
  path.write_text(text)
  with pytest.raises(DataError) as info:
    load_records(path)
  message = str(info.value)
  assert str(path) in message
  for part in expected:
    assert part in message


def test_skip_reports_what_and_why(tmp_path, caplog):
  rows = [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""},
          {"messages": [{"role": "user", "content": "x"}]}, {"prompt": "a", "completion": "c"}]
  path = write_jsonl(tmp_path / "d.jsonl", rows)
  with open(path, "a") as f:
    f.write("{not json\n")
  with caplog.at_level(logging.WARNING, logger="jaxsft.data"):
    report = SkipReport()
    records = load_records(path, on_error="skip", report=report)
  assert [r["messages"][1]["content"] for r in records] == ["b", "c"]
  assert report.total == 5 and report.num_skipped == 3
  assert [where for where, _ in report.skipped] == ["line 2", "line 3", "line 5"]
  assert "empty assistant reply" in report.skipped[0][1]
  assert "must end with an assistant turn" in report.skipped[1][1]
  assert report.skipped[2][1] == "invalid JSON: Expecting property name enclosed in double quotes (column 2)"
  assert "skipped 3 of 5 records" in caplog.text
  load_records(path, on_error="skip", report=report)
  assert report.total == 5 and report.num_skipped == 3  # a report passed again is refilled, not added to
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxsft.data"):
    with pytest.raises(DataError, match="every record was invalid:\n.*bad.jsonl: skipped 2 of 2 records"):
      load_records(write_jsonl(tmp_path / "bad.jsonl", rows[1:3]), on_error="skip")
  assert "skipped" not in caplog.text  # the error carries the report, printed once


def test_keys_that_partly_match_a_format_name_the_missing_field(tmp_path):
  path = tmp_path / "partial.jsonl"
  path.write_text('{"instruction": "q", "output": "a"}\n\n{"instruction": "a"}\n{"completion": "c"}\n')
  with pytest.raises(DataError, match=r"partial.jsonl: line 3: field 'output': missing \(keys \['instruction'\] "
                                      r"look like an Alpaca record"):
    load_records(path)
  report = SkipReport()
  load_records(path, on_error="skip", report=report)
  assert [(where, reason.split(" (")[0]) for where, reason in report.skipped] == [
      ("line 3", "field 'output': missing"), ("line 4", "field 'prompt': missing")]
  # the file's own field names, under a field map
  mapped = tmp_path / "mapped.jsonl"
  mapped.write_text('{"question": "q"}\n')
  with pytest.raises(DataError, match=r"line 1: field 'answer': missing .* needs 'question' and 'answer'"):
    load_records(mapped, field_map={"instruction": "question", "output": "answer"})


def test_invalid_json_names_the_column_within_its_line(tmp_path):
  path = tmp_path / "cut.jsonl"
  path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"\n')
  with pytest.raises(DataError, match=r"line 2: invalid JSON: Expecting ',' delimiter \(column 15\)$"):
    load_records(path)


def test_a_line_that_is_not_utf8_is_named_and_skippable(tmp_path):
  good = json.dumps({"prompt": "é" * 600, "completion": "b"}, ensure_ascii=False).encode() + b"\n"
  bad = b'{"prompt": "caf\xe9 ok", "completion": "b"}\n'  # Latin-1, past the first 1,024 bytes
  for name, opener in (("latin.jsonl", open), ("latin.jsonl.gz", gzip.open)):
    path = tmp_path / name
    with opener(path, "wb") as f:
      f.write(good * 3 + bad + good)
    with pytest.raises(DataError) as info:
      load_records(path)
    assert str(info.value) == f"{path}: line 4: not valid UTF-8 (byte 0xe9 at column 16)"
    report = SkipReport()
    assert len(load_records(path, on_error="skip", report=report)) == 4
    assert report.total == 5 and report.skipped == [("line 4", "not valid UTF-8 (byte 0xe9 at column 16)")]


def test_a_json_array_that_is_not_utf8_names_line_and_column(tmp_path, monkeypatch):
  from jaxsft.data import json_array

  monkeypatch.setattr(json_array, "CHUNK", 64)  # the bad byte lies several reads into the file
  rows = [{"instruction": f"é{i}", "output": "b"} for i in range(20)]
  text = json.dumps(rows, ensure_ascii=False, indent=1).encode()
  at = text.index("é19".encode())
  path = tmp_path / "bad.json"
  path.write_bytes(text[:at] + b"\xff" + text[at + 2:])
  line = text[:at].count(b"\n") + 1
  column = len(text[text.rfind(b"\n", 0, at) + 1:at].decode()) + 1
  with pytest.raises(DataError) as info:
    load_records(path, on_error="skip")
  assert str(info.value) == f"{path}: line {line}: not valid UTF-8 (byte 0xff at column {column})"
  path.write_bytes(b'[{"instruction": "a", "output": "b"},\n "\xc3')  # a character cut off by the file's end
  with pytest.raises(DataError, match=r"line 2: not valid UTF-8 \(byte 0xc3 at column 3\)$"):
    load_records(path)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
  rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}]
  for name, text in (("bom.jsonl", "".join(json.dumps(r) + "\n" for r in rows)), ("bom.json", json.dumps(rows))):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    report = SkipReport()
    records = load_records(path, on_error="skip", report=report)
    assert [r["messages"][0]["content"] for r in records] == ["a", "c"] and report.num_skipped == 0
  (tmp_path / "only.jsonl").write_bytes(b"\xef\xbb\xbf\n")
  with pytest.raises(DataError, match="empty file"):
    load_records(tmp_path / "only.jsonl")


def test_records_remember_where_they_were_read(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}] * 2)
  records = load_records(path)
  assert [(type(r), r.path, r.where) for r in records] == [(Record, str(path), "line 1"), (Record, str(path), "line 2")]
  assert records[0] == {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
  assert json.loads(json.dumps(records[0])) == records[0]
  again = pickle.loads(pickle.dumps(records[1]))  # as a Grain worker receives it
  assert again == records[1] and (again.path, again.where) == (str(path), "line 2")


def test_check_rejects_records_like_the_loader(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "no", "completion": "c"}])

  def check(record):
    if record["messages"][0]["content"] == "no":
      raise ValueError("assistant turn 1: refused")

  with pytest.raises(DataError, match=r"d.jsonl: line 2: assistant turn 1: refused$"):
    load_records(path, check=check)
  report = SkipReport()
  assert len(load_records(path, on_error="skip", report=report, check=check)) == 1
  assert report.skipped == [("line 2", "assistant turn 1: refused")]


@pytest.mark.parametrize("path, hub_hint", [("tatsu-lab/alpaca", True), ("gone.jsonl", False), ("data/gone.jsonl", False)])
def test_a_missing_data_path_is_named_and_a_hub_id_told_how_to_fetch_it(tmp_path, monkeypatch, path, hub_hint):
  from jaxsft.data.store import open_or_build

  monkeypatch.chdir(tmp_path)
  for load in (load_records, lambda p: open_or_build(p, None, max_length=64, cache_dir=tmp_path / "tokens")):
    with pytest.raises(DataError) as e:
      load(path)
    assert str(e.value).startswith(f"{path}: no such file")
    assert ("save_to_disk(FOLDER)" in str(e.value)) == hub_hint
  assert not (tmp_path / "tokens").exists()


def test_csv_and_tsv_cells_are_read_as_text_with_quoted_commas_and_newlines(tmp_path):
  import csv

  path = tmp_path / "qa.csv"
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerows([["instruction", "input", "output"], ["Add 2 and 40", "", "42"],
                      ["Write two lines", "about, commas", "line one\nline two"]])
  first, second = load_records(path)
  assert first["messages"] == [{"role": "user", "content": "Add 2 and 40"}, {"role": "assistant", "content": "42"}]
  assert second["messages"][0]["content"] == "Write two lines\n\nabout, commas"
  assert second["messages"][1]["content"] == "line one\nline two"
  assert (second.path, second.where) == (str(path), "row 1")
  tsv = tmp_path / "qa.tsv.gz"
  with gzip.open(tsv, "wt", newline="") as f:
    f.write("question\tanswer\nHow many?\t007\n")
  (record,) = load_records(tsv, field_map={"instruction": "question", "output": "answer"})
  assert record["messages"][1]["content"] == "007"  # as written, not an inferred integer


@pytest.mark.parametrize("text, words", [
    ('instruction,output\n"a","b"\n"c","d","e"\n', ["rows.csv", "cannot read", "Expected 2 columns, got 3"]),
    ("instruction,output\na,\n", ["rows.csv", "row 0", "output"]),
    ("instruction,output\n", ["rows.csv", "no records"]),
])
def test_a_bad_csv_names_the_file_and_what_is_wrong(tmp_path, text, words):
  path = tmp_path / "rows.csv"
  path.write_text(text)
  with pytest.raises(DataError) as e:
    load_records(path)
  for word in words:
    assert word in str(e.value), (word, str(e.value))


def test_openai_content_parts_and_developer_turns_are_read_as_text(tmp_path):
  path = tmp_path / "parts.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in [
      {"messages": [{"role": "developer", "content": "Be terse."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]},
  ]) + "\n")
  (record,) = load_records(path)
  assert record["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"},
                                {"role": "assistant", "content": "Hello"}]


@pytest.mark.parametrize("turn, words", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
     ["messages[0].content[0]", "'image_url'", "only text parts"]),
    ({"role": "user", "content": [{"type": "text"}]}, ["messages[0].content[0].text", "missing"]),
    ({"role": "user", "content": None, "tool_calls": [{"type": "function"}]},
     ["messages[0].content", "a tool call"]),
])
def test_content_a_text_model_cannot_train_is_named(tmp_path, turn, words):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"messages": [turn, {"role": "assistant", "content": "ok"}]}) + "\n")
  with pytest.raises(DataError) as e:
    load_records(path)
  for word in words:
    assert word in str(e.value), (word, str(e.value))
