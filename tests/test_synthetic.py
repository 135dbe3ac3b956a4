"""The embedded default dataset: determinism, schema, a length tail, and the answer checker."""

import json
import re

import numpy as np
import pytest

from jaxsft.data import synthetic


def test_deterministic_for_a_seed_and_prefix_stable():
  a = synthetic.make_dataset(200, seed=3)
  assert a == synthetic.make_dataset(200, seed=3)
  assert synthetic.make_dataset(50, seed=3) == a[:50]
  other = synthetic.make_dataset(200, seed=4)
  assert sum(x["messages"] != y["messages"] for x, y in zip(a, other)) > 150


def test_every_record_has_the_schema_and_a_correct_reply():
  records = synthetic.make_dataset(1000, seed=0)
  for i, record in enumerate(records):
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["user", "assistant"], i
    assert all(isinstance(m["content"], str) and m["content"].strip() for m in record["messages"]), i
    assert record["task"] in synthetic.TASKS, i
    assert record["answer"] and record["messages"][1]["content"] == f"Answer: {record['answer']}", i
    assert synthetic.score(record, record["messages"][1]["content"]), i
  assert {r["task"] for r in records} == set(synthetic.TASKS)


def word_after_items(prompt):
  return re.search(r"(?:list\? |List: |list )([\w, ]+?)(?:\n|, which|$)", prompt).group(1).split(", ")


def test_answers_are_right():
  """Recompute each task's answer from its prompt, independently of the generator."""
  checked = set()
  for record in synthetic.make_dataset(700, seed=1):
    prompt, answer, task = record["messages"][0]["content"], record["answer"], record["task"]
    if task == "lookup":
      key = re.search(r"code (?:of|belongs to) (\w+)", prompt).group(1)
      table = dict(re.findall(r"^(\w+): (\d+)$", prompt, flags=re.M))
      expected = table[key]
    elif task == "word_after":
      word, items = prompt.split("'")[1], word_after_items(prompt)
      expected = items[items.index(word) + 1]
    elif task == "uppercase":
      expected = prompt.split(": ", 1)[1].upper()
    else:
      assert task == "last_word", task
      items = prompt[len("List: "):].split("\n")[0] if prompt.startswith("List: ") else re.split(r"[?:] ", prompt, maxsplit=1)[1]
      expected = items.split(", ")[-1]
    assert answer == expected, record
    checked.add(task)
  assert checked == set(synthetic.TASKS)


def test_lookup_keys_and_listed_words_are_unique():
  """The answer is determined by the prompt: one row per key, one occurrence of the asked word."""
  for record in synthetic.make_dataset(300, seed=2):
    prompt = record["messages"][0]["content"]
    if record["task"] == "lookup":
      keys = re.findall(r"^(\w+): \d+$", prompt, flags=re.M)
      assert len(keys) == len(set(keys)) >= 3
    if record["task"] == "word_after":
      items = word_after_items(prompt)
      assert len(items) == len(set(items)) >= 3 and prompt.split("'")[1] in items[:-1]


def test_score_right_wrong_and_verbose():
  record = {"task": "add", "answer": "62"}
  assert synthetic.score(record, "Answer: 62")
  assert synthetic.score(record, "  Answer: 62  \n")
  assert synthetic.score(record, "Answer: 62<|im_end|>")
  assert synthetic.score(record, "17 + 45 = 62.\nAnswer: 62")  # reasoning first is fine
  assert not synthetic.score(record, "Answer: 63")
  assert not synthetic.score(record, "Answer: 620")
  assert not synthetic.score(record, "The answer is 62.")
  assert not synthetic.score(record, "Answer: 62.")  # strict format
  assert not synthetic.score(record, "Answer: 62\nI hope this helps!")  # must end with it
  assert not synthetic.score(record, "")
  phrase = {"task": "uppercase", "answer": "GOOD MORNING"}
  assert synthetic.score(phrase, "Answer: GOOD  MORNING")
  assert not synthetic.score(phrase, "Answer: Good Morning")
  with pytest.raises(KeyError, match="answer"):
    synthetic.score({"task": "add"}, "Answer: 1")


def test_task_score_overall_and_per_task():
  records = [{"task": "add", "answer": "3"}, {"task": "add", "answer": "5"},
             {"task": "reverse", "answer": "tac"}, {"task": "reverse", "answer": "god"}]
  result = synthetic.task_score(records, ["Answer: 3", "five", "Answer: tac", "Answer: dog"])
  assert result["correct"] == 2 and result["n"] == 4 and result["accuracy"] == 0.5
  assert result["format_rate"] == 0.75
  assert result["per_task"]["add"] == {"accuracy": 0.5, "format_rate": 0.5, "correct": 1, "n": 2}
  assert result["per_task"]["reverse"]["accuracy"] == 0.5
  assert synthetic.task_score([], [])["accuracy"] == 0.0
  with pytest.raises(ValueError, match="2 records but 1 generations"):
    synthetic.task_score(records[:2], ["Answer: 3"])


def test_write_jsonl_round_trips_atomically(tmp_path):
  records = synthetic.make_dataset(20, seed=2)
  path = synthetic.write_jsonl(records, tmp_path / "sub" / "default.jsonl")
  assert [json.loads(line) for line in path.read_text().splitlines()] == records
  assert sorted(p.name for p in path.parent.iterdir()) == ["default.jsonl"]  # no temp file left

  class Boom(Exception):
    pass

  def broken():
    yield records[0]
    raise Boom

  with pytest.raises(Boom):
    synthetic.write_jsonl(broken(), path)
  assert [json.loads(line) for line in path.read_text().splitlines()] == records  # old file intact
  assert sorted(p.name for p in path.parent.iterdir()) == ["default.jsonl"]


def test_length_distribution_has_a_long_tail(tokenizer):
  records = synthetic.make_dataset(600, seed=0)
  lengths = np.array([len(tokenizer.apply_chat_template(r["messages"], tokenize=True)["input_ids"])
                      for r in records])
  reply_lengths = [len(tokenizer(r["messages"][1]["content"])["input_ids"]) for r in records]
  assert 40 <= np.median(lengths) <= 120
  assert np.mean((lengths >= 40) & (lengths <= 120)) >= 0.75  # the bulk is short
  assert 0.05 <= np.mean(lengths > 150) <= 0.25  # a tail that makes bucketing matter
  assert 400 <= lengths.max() <= 512  # a long tail that still fits the default max_length
  assert max(reply_lengths) <= 15  # the default eval.max_new_tokens (16) suffices, end-of-turn included
