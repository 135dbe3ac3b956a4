"""load_records: formats, normalization, and DataError / skip reporting on bad input."""

import gzip
import json
import logging

import pytest

from jaxsft.data import DataError, SkipReport, load_records


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
     ["index 1", "unknown record format"]),
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
  assert report.skipped[2][1] == "invalid JSON"
  assert "skipped 3 of 5 records" in caplog.text
  load_records(path, on_error="skip", report=report)
  assert report.total == 5 and report.num_skipped == 3  # a report passed again is refilled, not added to
  with pytest.raises(DataError, match="every record was invalid"):
    load_records(write_jsonl(tmp_path / "bad.jsonl", rows[1:3]), on_error="skip")
