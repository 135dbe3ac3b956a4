"""The embedded default dataset: short instruction tasks with answers a program can check.

`make_dataset(n, seed=...)` generates `n` chat records deterministically. Record `i` depends only
on `(seed, i)`, so `make_dataset(100)` is a prefix of `make_dataset(1000)`. Every reply is
exactly one line, `Answer: <x>`: the base model never answers in that form, so it scores ~0,
and the answer itself has to be found in the prompt, so a tuned model scores only by doing the
task. The tasks are ones a 135M model learns in one LoRA epoch of a few dozen steps: each
answer is copied (looked up, or upper-cased) from the prompt.

Tasks (drawn uniformly):

  lookup      "Codes:\nriver: 417\nstone: 932\n...\nWhich code belongs to stone?"  -> Answer: 932
  word_after  "Which word comes right after 'cat' in this list? dog, cat, sun"     -> Answer: sun
  last_word   "What is the last word in this list? ..."                          -> Answer: river
  uppercase   "Convert this phrase to uppercase: good morning"                   -> Answer: GOOD MORNING

Lookup keys and word_after lists are distinct words, so every answer is determined. The list
tasks are long with probability `_LONG_PROB`, sized by a log-uniform token budget of 100-450,
which gives the length distribution a tail. Measured with the SmolLM2 chat template (default
system prompt included) on 2000 records: median 57 tokens, 91% within 40-120, 8.7% over 150,
max ~500 (within the default max_length 512), mean ~81; the tail holds ~30% of all
tokens. That is what makes length bucketing matter. Replies are at most 13 tokens (end-of-turn
included).

`score(record, text)` is an exact match: the reply (trailing whitespace and end-of-turn markers
removed) must end with a last line `Answer: <x>` where `<x>` equals the record's answer after
collapsing runs of whitespace. "Answer: 5." or "The answer is 5" do not count.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

TASKS = ("lookup", "word_after", "last_word", "uppercase")
_LONG_PROB = 0.12  # of a list task being long (-> ~9% of all records)
_SHORT_ITEMS = (3, 8)  # item count range of a short list
_LONG_TOKENS = (100, 450)  # log-uniform token budget of a long list (fits max_length 512)
# Tokens per item with the SmolLM2 tokenizer (measured): "word: 123\n", "word, ".
_TOKENS_PER_ITEM = {"lookup": 7.5, "word_after": 2.0, "last_word": 2.0}

# Common lowercase words, mostly one token each: keys, list items and phrases.
_WORDS = tuple("""
apple river stone cloud green table window bread light music garden house water paper
orange winter summer forest yellow silver chair pencil rabbit tiger horse mouse candle
bottle flower planet rocket market castle bridge island valley desert ocean thunder
morning evening friend letter button pocket basket ladder mirror blanket kitchen doctor
farmer sailor artist singer teacher student camera engine wheel street corner circle
square purple violet copper cotton velvet marble pepper ginger honey butter cheese lemon
cherry peach grape melon tomato potato carrot onion garlic salad coffee sugar salt
bright quiet happy gentle simple little narrow heavy rapid sharp smooth warm cold clever
brave calm eager fancy jolly kind lucky proud silly tiny wise wild young old early late
run jump walk swim sing read write paint build climb dance laugh dream sleep think
""".split())

_LOOKUP = ("Here are some item codes:\n{table}\nWhat is the code of {key}?",
           "Codes:\n{table}\nWhich code belongs to {key}?",
           "Look up the code of {key} in this table.\n{table}")
_WORD_AFTER = ("Which word comes right after '{w}' in this list? {items}",
               "List: {items}\nWhat is the word that follows '{w}'?",
               "In the list {items}, which word is next after '{w}'?")
_UPPERCASE = ("Convert this phrase to uppercase: {p}", "Write in capital letters: {p}",
              "Rewrite the following in upper case: {p}")
_LAST_WORD = ("What is the last word in this list? {items}", "Which word comes last in this list: {items}",
              "List: {items}\nWhat is the final item?")


def _item_count(rng: np.random.Generator, task: str) -> int:
  """Items in a list: usually 3-8, with probability _LONG_PROB a long-tail length (distinct
  words run out at len(_WORDS), which caps the longest lookup table and word_after list)."""
  if rng.random() < _LONG_PROB:
    lo, hi = np.log(_LONG_TOKENS)
    return min(int(round(np.exp(rng.uniform(lo, hi)) / _TOKENS_PER_ITEM[task])), len(_WORDS))
  return int(rng.integers(_SHORT_ITEMS[0], _SHORT_ITEMS[1] + 1))


def _pick(rng: np.random.Generator, options: Sequence[str], size: int | None = None):
  if size is None:
    return options[int(rng.integers(len(options)))]
  return [options[i] for i in rng.integers(len(options), size=size)]


def _distinct(rng: np.random.Generator, size: int) -> list[str]:
  return [_WORDS[i] for i in rng.choice(len(_WORDS), size=size, replace=False)]


def _make_task(task: str, rng: np.random.Generator) -> tuple[str, str]:
  """(prompt, answer) for one task."""
  if task == "lookup":
    keys = _distinct(rng, _item_count(rng, task))
    codes = [str(int(c)) for c in rng.integers(100, 1000, size=len(keys))]
    key = int(rng.integers(len(keys)))
    table = "\n".join(f"{k}: {c}" for k, c in zip(keys, codes))
    return _pick(rng, _LOOKUP).format(table=table, key=keys[key]), codes[key]
  if task == "word_after":
    items = _distinct(rng, _item_count(rng, task))
    i = int(rng.integers(len(items) - 1))
    return _pick(rng, _WORD_AFTER).format(items=", ".join(items), w=items[i]), items[i + 1]
  if task == "uppercase":
    phrase = " ".join(_pick(rng, _WORDS, int(rng.integers(1, 4))))
    return _pick(rng, _UPPERCASE).format(p=phrase), phrase.upper()
  if task == "last_word":
    items = _pick(rng, _WORDS, _item_count(rng, task))
    return _pick(rng, _LAST_WORD).format(items=", ".join(items)), items[-1]
  raise ValueError(f"unknown task {task!r}; known: {TASKS}")


def make_record(index: int, *, seed: int = 0) -> dict[str, Any]:
  """Record `index` of the dataset with this seed (independent of every other index)."""
  rng = np.random.default_rng([seed, index])
  task = TASKS[int(rng.integers(len(TASKS)))]
  prompt, answer = _make_task(task, rng)
  return {
      "messages": [{"role": "user", "content": prompt},
                   {"role": "assistant", "content": f"Answer: {answer}"}],
      "task": task,
      "answer": answer,
      "id": f"synthetic-{seed}-{index}",
  }


def make_dataset(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
  """`n` records; record i is `make_record(i, seed=seed)` (so a smaller n gives a prefix)."""
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  return [make_record(i, seed=seed) for i in range(n)]


_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>")


def extract_answer(text: str) -> str | None:
  """The `<x>` of a reply whose last line is `Answer: <x>`, else None."""
  text = text.strip()
  stripped = True
  while stripped:  # decoders may leave end-of-turn markers in
    stripped = False
    for marker in _END_MARKERS:
      if text.endswith(marker):
        text, stripped = text[: -len(marker)].rstrip(), True
  last_line = text.rsplit("\n", 1)[-1]
  match = re.search(r"(?:^|\s)Answer:[ \t]*(\S.*)$", last_line)
  return " ".join(match.group(1).split()) if match else None


def score(record: Mapping[str, Any], generated_text: str) -> bool:
  """Exact match of the reply's final `Answer: <x>` line with the record's answer."""
  if "answer" not in record:
    raise KeyError(f"record {record.get('id', '?')!r} has no 'answer' field to score against")
  found = extract_answer(generated_text)
  return found is not None and found == " ".join(str(record["answer"]).split())


def task_score(records: Sequence[Mapping[str, Any]], generations: Sequence[str]) -> dict[str, Any]:
  """Accuracy overall and per task, plus how often the reply had the `Answer: <x>` form.

  Returns {"accuracy", "format_rate", "correct", "n", "per_task": {task: {"accuracy",
  "format_rate", "correct", "n"}}}; accuracies are fractions in [0, 1] (0 for n == 0).
  """
  if len(records) != len(generations):
    raise ValueError(f"task_score: {len(records)} records but {len(generations)} generations")
  counts = collections.defaultdict(lambda: [0, 0, 0])  # task -> [correct, well formed, n]
  for i, (record, text) in enumerate(zip(records, generations)):
    if "answer" not in record:
      raise KeyError(f"task_score: record {i} has no 'answer' field")
    for key in ("*", str(record.get("task", "unknown"))):
      counts[key][0] += score(record, text)
      counts[key][1] += extract_answer(text) is not None
      counts[key][2] += 1

  def summary(correct, formatted, n):
    return {"accuracy": correct / n if n else 0.0, "format_rate": formatted / n if n else 0.0,
            "correct": correct, "n": n}

  result = summary(*counts.pop("*", [0, 0, 0]))
  result["per_task"] = {task: summary(*counts[task]) for task in sorted(counts)}
  return result


def write_jsonl(records: Iterable[Mapping[str, Any]], path: str | os.PathLike) -> pathlib.Path:
  """Write one JSON object per line, atomically (a temp file in the same folder, then rename)."""
  from jaxsft.io import atomic_write

  def write(f):
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")

  return atomic_write(path, write)
