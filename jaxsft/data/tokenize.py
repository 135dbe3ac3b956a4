"""Chat records to token ids and labels, masked from the reply spans in the rendered text.

A record `{"messages": [...]}` is rendered with the tokenizer's chat template
(`apply_chat_template(..., tokenize=False)`) and tokenized once with character offsets. The
trained characters of assistant turn i are found by rendering prefixes of the conversation:

  - `G_i = render(messages[:i], add_generation_prompt=True)` ends where the reply starts
    (the generation prompt, e.g. `<|im_start|>assistant\\n`, is not trained);
  - `P_i = render(messages[:i+1])` ends after the turn; the text between the reply's end and
    `len(P_i)`, without trailing whitespace, is its end-of-turn marker (`<|im_end|>` in ChatML)
    and is trained too.

A token is trained when its character span overlaps a trained span: with SmolLM2 a reply that
starts with "\\n" merges with the "\\n" after `assistant` into one token, which is then trained
(the token-prefix approach would misalign here). Labels are never derived from comparing ids
with the pad or eos id (SmolLM2's pad == eos == `<|im_end|>`).

Tokenizers without a chat template use `PLAIN_CHAT_TEMPLATE`:

    {system}\\n\\n                      (if any)
    User: {user}\\n\\n
    Assistant: {reply}{eos_token}\\n\\n

with generation prompt `Assistant: `. The rendered text is always tokenized with
`add_special_tokens=False` (templates already contain their special tokens, so there is no double
BOS); a tokenizer that adds a BOS by default gets its BOS text prepended once when the rendered
text does not already start with it.

Two encoders: `tokenize_example` (one record) and `tokenize_records` (many, encoded in batches),
which returns a `TokenizedRecords`: the tokenization a caller keeps and passes to the pipeline's
entry points so that they encode nothing again.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxsft.labels import IGNORE_INDEX

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + (eos_token or '') + '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")

TRAIN_ON = ("all_assistant", "last")


def _render(tokenizer, messages, *, generation_prompt=False) -> str:
  return tokenizer.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=generation_prompt,
      chat_template=None if getattr(tokenizer, "chat_template", None) else PLAIN_CHAT_TEMPLATE)


def _bos_prefix(tokenizer) -> str:
  """The BOS text to prepend by hand: non-empty only if the tokenizer adds a BOS by default."""
  cached = getattr(tokenizer, "_jaxsft_bos_prefix", None)
  if cached is not None:
    return cached
  bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
  prefix = ""
  if bos and bos_id is not None:
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    prefix = bos if ids and ids[0] == bos_id else ""
  try:
    tokenizer._jaxsft_bos_prefix = prefix
  except AttributeError:
    pass
  return prefix


def render_with_spans(tokenizer, record: dict, *, train_on: str = "all_assistant") -> tuple[str, list[tuple[int, int]]]:
  """The rendered conversation and the character spans `[start, end)` to train.

  Raises ValueError when a reply cannot be located in the rendered text (a template that
  rewrites content or renders earlier turns differently once later turns exist).
  """
  if train_on not in TRAIN_ON:
    raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
  messages = record["messages"]
  full = _render(tokenizer, messages)
  turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  if train_on == "last":
    turns = turns[-1:]
  spans = []
  for i in turns:
    turn = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1])
    if not full.startswith(turn):
      raise ValueError(f"chat template renders turns 0..{i} differently once later turns follow; "
                       "cannot locate the reply span")
    header = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
    lo = len(header) if turn.startswith(header) else len(_render(tokenizer, messages[:i]) if i else "")
    content = messages[i]["content"]
    start = turn.find(content, lo)
    if start < 0:  # templates that trim the content
      content = content.strip()
      start = turn.find(content, lo)
    if start < 0 or not content:
      raise ValueError(f"assistant turn {i}: reply text not found in the rendered conversation")
    end = start + len(content)
    end += len(turn[end:].rstrip())  # the end-of-turn marker is trained
    spans.append((start, end))
  bos = _bos_prefix(tokenizer)
  if bos and not full.startswith(bos):
    full = bos + full
    spans = [(s + len(bos), e + len(bos)) for s, e in spans]
  return full, spans


def _labels_from_offsets(ids: np.ndarray, offsets: np.ndarray, spans) -> np.ndarray:
  """labels[t] = ids[t] where token t's characters overlap a trained span, else -100."""
  labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
  starts, ends = offsets[:, 0], offsets[:, 1]
  nonempty = ends > starts
  for s, e in spans:
    hit = nonempty & (starts < e) & (ends > s)
    if not hit.any():
      raise ValueError(f"the reply at characters [{s}, {e}) maps to no token")
    labels[hit] = ids[hit]
  return labels


def _finish(ids, offsets, spans, max_length) -> tuple[dict | None, int]:
  ids = np.asarray(ids, dtype=np.int32)
  labels = _labels_from_offsets(ids, np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)
  full_length = len(ids)
  ids, labels = ids[:max_length], labels[:max_length]
  if not (labels != IGNORE_INDEX).any():
    return None, full_length
  return {"input_ids": ids, "labels": labels}, full_length


def _backend(tokenizer):
  backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
  if backend is None or not getattr(tokenizer, "is_fast", True):
    raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer: character offsets are needed "
                    "to mask labels (load it with use_fast=True)")
  return backend


def tokenize_example(tokenizer, record: dict, *, max_length: int, train_on: str = "all_assistant") -> dict | None:
  """Tokenizes one chat record into input ids and labels.

  Args:
    tokenizer: a fast Hugging Face tokenizer.
    record: `{"messages": [...]}` ending with an assistant turn (see `load_records`).
    max_length: longer examples keep their first `max_length` tokens.
    train_on: `"all_assistant"` (every reply) or `"last"` (only the final reply).

  Returns:
    `{"input_ids": int32[L], "labels": int32[L]}` with `L <= max_length` and labels -100 on every
    token outside the trained replies, or None when truncation left no trained token.
  """
  return _encode_with_length(tokenizer, record, max_length=max_length, train_on=train_on)[0]


def _encode_with_length(tokenizer, record: dict, *, max_length: int, train_on: str) -> tuple[dict | None, int]:
  """`tokenize_example` plus the token count before truncation (the pipeline counts truncations)."""
  text, spans = render_with_spans(tokenizer, record, train_on=train_on)
  enc = _backend(tokenizer).encode(text, add_special_tokens=False)
  return _finish(enc.ids, enc.offsets, spans, max_length)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: identity, not an elementwise array comparison
class TokenizedRecords:
  """Every record of a list tokenized once with one `max_length` and `train_on`.

  The caller owns it and passes it to `make_batches`, `batch_shapes` and `count_batches`, which
  then encode nothing; they raise ValueError when its record count, `max_length` or `train_on`
  differ from theirs. Treat it (and the records it came from) as immutable.

  Attributes:
    examples: examples[i] is `tokenize_example(...)` of records[i], None when truncation left no
      trained token (the pipeline drops it).
    full_lengths: int64[N], the token count of records[i] before truncation.
    max_length, train_on: the settings it was tokenized with.
  """

  examples: list[dict | None]
  full_lengths: np.ndarray
  max_length: int
  train_on: str

  def __len__(self) -> int:
    return len(self.examples)

  @property
  def lengths(self) -> np.ndarray:
    """int64 token counts (after truncation) of the kept examples, in record order."""
    return np.array([len(e["input_ids"]) for e in self.examples if e is not None], dtype=np.int64)

  def with_max_length(self, max_length: int) -> TokenizedRecords:
    """The same records at a smaller `max_length`, without encoding again.

    Exact: labels are computed on the whole text before truncation keeps a prefix, so cutting a
    longer prefix again equals tokenizing at `max_length` (examples left with no trained token
    become None). A larger `max_length` is possible only if no record was cut.
    """
    if max_length > self.max_length and (self.full_lengths > self.max_length).any():
      raise ValueError(f"cannot extend a tokenization cut at max_length {self.max_length} to {max_length}")
    examples = [None if e is None else _cut(e, max_length) for e in self.examples]
    return TokenizedRecords(examples, self.full_lengths, max_length, self.train_on)

  def check_matches(self, *, num_records: int | None, max_length: int, train_on: str) -> None:
    """Raises ValueError naming the first setting that differs from how these records were tokenized."""
    if num_records is not None and num_records != len(self):
      raise ValueError(f"tokenized holds {len(self)} records but {num_records} records were passed")
    if max_length != self.max_length:
      raise ValueError(f"tokenized was made with max_length={self.max_length}, but max_length={max_length} was "
                       "passed (tokenized.with_max_length(max_length) re-cuts it without encoding)")
    if train_on != self.train_on:
      raise ValueError(f"tokenized was made with train_on={self.train_on!r}, but train_on={train_on!r} was passed")


def _cut(example: dict, max_length: int) -> dict | None:
  labels = example["labels"][:max_length]
  return {"input_ids": example["input_ids"][:max_length], "labels": labels} if (labels != IGNORE_INDEX).any() else None


def tokenize_records(tokenizer, records: Sequence[dict], *, max_length: int, train_on: str = "all_assistant",
                     batch_size: int = 256) -> TokenizedRecords:
  """`tokenize_example` over many records, encoding `batch_size` texts per call (the Rust
  tokenizer then uses its own threads where `TOKENIZERS_PARALLELISM` allows).

  Returns:
    A `TokenizedRecords` (the examples and their lengths before truncation), to pass to
    `make_batches`, `batch_shapes` and `count_batches` so that none of them tokenizes again.
  """
  backend = _backend(tokenizer)
  examples: list[dict | None] = []
  full_lengths = np.zeros(len(records), dtype=np.int64)
  for lo in range(0, len(records), batch_size):
    rendered = []
    for i, record in enumerate(records[lo:lo + batch_size], start=lo):
      try:
        rendered.append(render_with_spans(tokenizer, record, train_on=train_on))
      except ValueError as e:
        raise ValueError(f"record {i}: {e}") from None
    encodings = backend.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    for j, ((_, spans), enc) in enumerate(zip(rendered, encodings)):
      example, full_lengths[lo + j] = _finish(enc.ids, enc.offsets, spans, max_length)
      examples.append(example)
  return TokenizedRecords(examples, full_lengths, max_length, train_on)
