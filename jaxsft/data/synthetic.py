"""The embedded default dataset: short instruction tasks with answers a program can check.

`make_dataset(n, seed=...)` generates `n` chat records deterministically. Record `i` depends only
on `(seed, i)`, so `make_dataset(100)` is a prefix of `make_dataset(1000)` and a held-out split is
simply another seed. Every reply is exactly one line, `Answer: <x>`: the base model rarely answers
in that form, so an untuned model scores low mostly on format, and a LoRA run of a few dozen steps
learns the format (and part of the tasks).

Tasks (drawn uniformly):

  add            "What is 17 + 45?"                         -> Answer: 62
  count_words    "How many words are in this text? ..."     -> Answer: 7
  count_letter   "How many times does 'r' appear in ..."    -> Answer: 3
  reverse        "Reverse the word 'cat'."                  -> Answer: tac
  uppercase      "Convert to uppercase: good morning"       -> Answer: GOOD MORNING
  largest        "Which number is the largest? 3, 17, 9"    -> Answer: 17
  last_word      "What is the last word in this list? ..."  -> Answer: river

The list/passage tasks (`count_words`, `largest`, `last_word`) are long with probability
`_LONG_PROB`, sized by a log-uniform token budget of 100-700, which gives the length
distribution a tail. Measured with the SmolLM2 chat template (default system prompt included)
on 2000 records: median 51 tokens, 91% within 40-120, 8% over 150, 1.2% over 600, max ~830,
mean 80 (the tail holds ~40% of all tokens). That is what makes length bucketing matter.
Replies are at most 12 tokens.

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

TASKS = ("add", "count_words", "count_letter", "reverse", "uppercase", "largest", "last_word")
_LONG_PROB = 0.2  # of a list/passage task being long (-> ~9% of all records)
_SHORT_ITEMS = (3, 9)  # item count range of a short list/passage
_LONG_TOKENS = (100, 700)  # log-uniform token budget of a long list/passage
# Tokens per item with the SmolLM2 tokenizer (measured): a passage word, "word, ", "123, ".
_TOKENS_PER_ITEM = {"count_words": 1.2, "last_word": 2.0, "largest": 4.0}

# Common lowercase words, mostly one token each: fillers for passages, lists and letter tasks.
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
_SHORT_WORDS = tuple(w for w in _WORDS if 3 <= len(w) <= 6)

_ADD = ("What is {a} + {b}?", "Add {a} and {b}.", "Compute the sum of {a} and {b}.",
        "What do you get when you add {a} to {b}?")
_COUNT_WORDS = ("How many words are in this text?\n{text}", "Count the words in the following text.\n{text}",
                "Text: {text}\nHow many words does this text contain?")
_COUNT_LETTER = ("How many times does the letter '{c}' appear in the word '{w}'?",
                 "Count the letter '{c}' in '{w}'.", "In the word '{w}', how many '{c}' letters are there?")
_REVERSE = ("Reverse the word '{w}'.", "Write '{w}' backwards.", "Spell the word '{w}' in reverse order.")
_UPPERCASE = ("Convert this phrase to uppercase: {p}", "Write in capital letters: {p}",
              "Rewrite the following in upper case: {p}")
_LARGEST = ("Which number is the largest in this list? {nums}", "Find the largest number: {nums}",
            "Numbers: {nums}\nWhat is the biggest one?")
_LAST_WORD = ("What is the last word in this list? {items}", "Which word comes last in this list: {items}",
              "List: {items}\nWhat is the final item?")


def _item_count(rng: np.random.Generator, task: str) -> int:
  """Items in a list/passage: usually 3-9, with probability _LONG_PROB a long-tail length."""
  if rng.random() < _LONG_PROB:
    lo, hi = np.log(_LONG_TOKENS)
    return int(round(np.exp(rng.uniform(lo, hi)) / _TOKENS_PER_ITEM[task]))
  return int(rng.integers(_SHORT_ITEMS[0], _SHORT_ITEMS[1] + 1))


def _pick(rng: np.random.Generator, options: Sequence[str], size: int | None = None):
  if size is None:
    return options[int(rng.integers(len(options)))]
  return [options[i] for i in rng.integers(len(options), size=size)]


def _make_task(task: str, rng: np.random.Generator) -> tuple[str, str]:
  """(prompt, answer) for one task."""
  if task == "add":
    a, b = (int(x) for x in rng.integers(0, 100, size=2))
    return _pick(rng, _ADD).format(a=a, b=b), str(a + b)
  if task == "count_words":
    words = _pick(rng, _WORDS, _item_count(rng, task))
    return _pick(rng, _COUNT_WORDS).format(text=" ".join(words)), str(len(words))
  if task == "count_letter":
    word = _pick(rng, _WORDS)
    # Mostly a letter of the word (counts 1-3), sometimes one it lacks (count 0).
    letter = _pick(rng, word) if rng.random() < 0.8 else _pick(rng, "abcdefghijklmnopqrstuvwxyz")
    return _pick(rng, _COUNT_LETTER).format(c=letter, w=word), str(word.count(letter))
  if task == "reverse":
    word = _pick(rng, _SHORT_WORDS)
    return _pick(rng, _REVERSE).format(w=word), word[::-1]
  if task == "uppercase":
    phrase = " ".join(_pick(rng, _WORDS, int(rng.integers(1, 4))))
    return _pick(rng, _UPPERCASE).format(p=phrase), phrase.upper()
  if task == "largest":
    nums = [int(x) for x in rng.choice(1000, size=max(_item_count(rng, task), 2), replace=False)]
    return _pick(rng, _LARGEST).format(nums=", ".join(map(str, nums))), str(max(nums))
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
  from jaxsft.run_files import atomic_write

  def write(f):
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")

  return atomic_write(path, write)
