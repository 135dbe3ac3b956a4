"""Chat records to token ids and labels, masked from the reply spans in the rendered text.

A record `{"messages": [...]}` is rendered with the tokenizer's chat template
(`apply_chat_template(..., tokenize=False)`) into F, the whole conversation, and tokenized once
with character offsets. The trained characters of assistant turn i are located in F itself: a
template may render a turn differently once later turns follow (Qwen3 gives only the turn after
the last user query a think block), so renders of a part of the conversation are used only for
what comes before the turn and for the template text after a reply:

  - start: `G_i = render(messages[:i], add_generation_prompt=True)`. F must start with it, and
    everything after it is the model's to produce: the generation prompt (e.g.
    `<|im_start|>assistant\\n`) is not trained, what the template renders between it and the
    reply's text is (Qwen3's `<think>\\n\\n</think>\\n\\n`). For a first message, or where F does
    not start with `G_i`, the reply starts where its text (or its stripped text) is found after
    `render(messages[:i])`.
  - reply end: F rendered with turn i's text replaced by a sentinel; the text after the sentinel
    must be a suffix of F (the rest of the conversation does not depend on the reply's text), and
    the reply ends where that suffix begins, also when the template trims the reply or moves its
    reasoning out.
  - end-of-turn marker, trained too: `P_i = render(messages[:i+1])` (turn i last) gives the text
    after the reply when it ends the conversation. The marker is the longest part of it, cut
    before whitespace and without trailing whitespace, that the render also continues with when
    another turn follows (F after the reply; for the final turn, F with a user turn appended):
    `<|im_end|>` (ChatML), `<end_of_turn>` (Gemma), `<|end|>` (Phi-3, whose `<|endoftext|>` after
    the final turn closes the conversation and is not trained), the eos (OLMo 2).

Reasoning templates: the labels follow F. Qwen3 renders the turn after the last user query as
`<think>\\n{reasoning}\\n</think>\\n\\n{reply}` (the reasoning from `reasoning_content` or from a
reply written as `<think>...</think>...`, else empty) and all of it is trained, as its generation
prompt does not contain the block; earlier turns render without their reasoning, and only what is
rendered is trained. SmolLM3 in /think mode (the default) renders replies as written, a
`<think>...</think>` included, and trains them; with /no_think in the system message its
generation prompt ends with the empty `<think>\\n\\n</think>\\n` block, which is then prompt.

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

Two encoders: `tokenize_example` (one record, the reference) and `tokenize_records` (many, through
`encode_batches`), which returns a `TokenizedRecords`: the tokenization a caller keeps and passes to
the pipeline's entry points so that they encode nothing again. `encode_batches` is also what the
token store (store.py) writes, so both give exactly `tokenize_example`'s examples.

A record the template cannot label (its reply cannot be located, or the template's
`raise_exception` rejects it) is bad data: `tokenize_records` raises `DataError` naming where the
record was read (a `records.Record`), else its index. `tokenize_file` and the token store render
each record as it is loaded, so such a record is raised or skipped (`on_error="skip"`) and reported
like the loader's own bad records. (A reply whose characters map to no token shows only once its
batch is encoded: it is raised, named the same way, under either policy.)

Fast path (`SpanRenderer`, used by `encode_batches`): the rule above costs three or four template
renders per assistant turn (`render_with_spans`, the reference). Instead, each conversation
*shape* (the roles, and which contents are empty) is rendered once with unique sentinel strings in
place of the contents; that gives the template text around every content and, in sentinel
coordinates, every quantity the rule needs (where each generation prompt and each reply end, the
template text after a reply). A conversation is then rendered once, and the fast path is taken
only if that text equals the sentinel skeleton with the contents put back (the template treats the
contents as opaque text); the rule is then applied to the verified text, with the positions mapped
from sentinel to real coordinates (the marker of a turn that is not the last is cut against the
real text that follows it). Otherwise (a template that trims, escapes or branches on content) the
record takes the reference path.

Labels from character offsets need every token's offsets (a Python list per example, ~15% of the
encode time). For byte-level BPE tokenizers without a normalizer or offset trimming, every token
covers at least one character and offsets never decrease, so the overlapping tokens of a span
[s, e) are one contiguous run: from the first token containing character s to the last token
containing character e - 1, found with `char_to_token` and `token_to_chars` (a few calls per span).
Other tokenizers use the offsets.
"""

from __future__ import annotations

import array
import concurrent.futures
import dataclasses
import json
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from jaxsft.data.records import DataError, SkipReport, iter_records
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
  try:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt,
        chat_template=None if getattr(tokenizer, "chat_template", None) else PLAIN_CHAT_TEMPLATE)
  except Exception as e:
    if _template_rejects(e):
      raise DataError(f"the chat template rejects the conversation: {e}") from None
    raise


def _template_rejects(e: Exception) -> bool:
  """A template's `raise_exception` (a conversation it refuses, e.g. roles that do not alternate),
  not a template that does not compile."""
  import jinja2

  return isinstance(e, jinja2.TemplateError) and not isinstance(e, jinja2.TemplateSyntaxError)


def _record_error(e: ValueError, record, index: int | None = None) -> DataError:
  """A record's tokenization failure as a `DataError` naming where the record was read (a
  `records.Record`), else `record {index}`."""
  where = getattr(record, "where", None) or (None if index is None else f"record {index}")
  return DataError(getattr(e, "reason", str(e)), path=getattr(record, "path", None), where=where,
                   field=getattr(e, "field", None))


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
  """The rendered conversation and the character spans `[start, end)` to train (the rule in the
  module docstring).

  Raises ValueError when a reply cannot be located in the rendered text (a template that drops or
  repeats the reply, renders the rest of the conversation differently depending on the reply's
  text, or renders the turns before it differently once it follows).
  """
  if train_on not in TRAIN_ON:
    raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
  messages = record["messages"]
  full = _render(tokenizer, messages)
  turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  if train_on == "last":
    turns = turns[-1:]
  spans = [_turn_span(tokenizer, messages, full, i) for i in turns]
  bos = _bos_prefix(tokenizer)
  if bos and not full.startswith(bos):
    full = bos + full
    spans = [(s + len(bos), e + len(bos)) for s, e in spans]
  return full, spans


# Private-use sentinels (like `_SENTINEL` below) for the reply being located and for a turn appended after it.
_PROBE, _NEXT_PROBE = "\ue000jaxsft-reply\ue001", "\ue000jaxsft-next\ue001"


def _turn_span(tokenizer, messages: list, full: str, i: int) -> tuple[int, int]:
  """The trained span of assistant turn i in `full`, the render of the whole conversation."""
  render = lambda msgs, gen=False: _render(tokenizer, msgs, generation_prompt=gen)
  content = messages[i]["content"]
  if not content:
    raise ValueError(f"assistant turn {i}: reply text not found in the rendered conversation")
  probed = messages[:i] + [{**messages[i], "content": _PROBE}] + messages[i + 1:]
  text = render(probed)
  if text.count(_PROBE) != 1:
    raise ValueError(f"assistant turn {i}: the chat template does not render the reply exactly once")
  tail = text[text.index(_PROBE) + len(_PROBE):]
  if not full.endswith(tail):
    raise ValueError(f"assistant turn {i}: the chat template renders the rest of the conversation differently "
                     "depending on the reply's text; cannot locate the reply span")
  reply_end = len(full) - len(tail)
  header = render(messages[:i], True) if i else ""
  if i and full.startswith(header) and len(header) < reply_end:
    start = len(header)  # everything after the generation prompt is the model's to produce
  else:
    before = render(messages[:i]) if i else ""
    if not full.startswith(before):
      raise ValueError(f"chat template renders turns 0..{i - 1} differently once later turns follow; "
                       "cannot locate the reply span")
    start = _find_reply(full, content, len(before), reply_end)
    if start < 0:
      raise ValueError(f"assistant turn {i}: reply text not found in the rendered conversation")
  if start >= reply_end:
    raise ValueError(f"assistant turn {i}: reply text not found in the rendered conversation")
  last = render(probed[: i + 1])
  after = last[last.index(_PROBE) + len(_PROBE):] if last.count(_PROBE) == 1 else ""
  if i + 1 < len(messages):
    marker = _end_marker(after, full, reply_end)
  else:
    following = _following_turn(render, probed, _PROBE)
    marker = _end_marker(after, after if following is None else following)
  return start, reply_end + len(marker)


def _find_reply(text: str, content: str, lo: int, hi: int) -> int:
  """Where `content` (or, for templates that trim it, its stripped text) starts in text[lo:hi]; -1 if nowhere."""
  start = text.find(content, lo, hi)
  if start < 0 and content.strip():
    start = text.find(content.strip(), lo, hi)
  return start


def _following_turn(render, messages: list, reply: str) -> str | None:
  """What the template renders after the final reply (the text `reply`) when a user turn follows
  it; None when the template rejects that conversation."""
  try:
    text = render(messages + [{"role": "user", "content": _NEXT_PROBE}])
  except Exception:  # a template that rejects a trailing user turn: the end-of-turn text decides alone
    return None
  return text[text.index(reply) + len(reply):] if text.count(reply) == 1 else None


def _end_marker(after: str, following: str, at: int = 0) -> str:
  """The end-of-turn marker: the longest prefix of `after` (what the template renders after a reply
  that ends the conversation), cut before whitespace and without trailing whitespace, that
  following[at:] (what it renders after the same reply when the conversation goes on) starts with."""
  end = len(after.rstrip())
  for cut in [end] + [p for p in range(end - 1, 0, -1) if after[p].isspace()]:
    marker = after[:cut].rstrip()
    if following.startswith(marker, at):
      return marker
  return ""


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
      trained token (the pipeline drops it). A list, or a `store.StoredExamples` that reads each
      example from a memory-mapped token store on access.
    full_lengths: int64[N], the token count of records[i] before truncation.
    max_length, train_on: the settings it was tokenized with.
  """

  examples: Sequence[dict | None]
  full_lengths: np.ndarray
  max_length: int
  train_on: str

  def __len__(self) -> int:
    return len(self.examples)

  @property
  def lengths(self) -> np.ndarray:
    """int64 token counts (after truncation) of the kept examples, in record order."""
    if hasattr(self.examples, "kept_lengths"):  # a store: from its length arrays, nothing is read
      return self.examples.kept_lengths()
    return np.array([len(e["input_ids"]) for e in self.examples if e is not None], dtype=np.int64)

  @property
  def num_dropped(self) -> int:
    """Records that truncation left with no trained token."""
    return len(self) - len(self.lengths)

  def take(self, indices: Sequence[int]) -> TokenizedRecords:
    """The records at `indices`, in that order (a view when backed by a store)."""
    indices = np.asarray(indices, dtype=np.int64)
    if hasattr(self.examples, "take"):
      examples = self.examples.take(indices)
    else:
      examples = [self.examples[i] for i in indices]
    return TokenizedRecords(examples, self.full_lengths[indices], self.max_length, self.train_on)

  def with_max_length(self, max_length: int) -> TokenizedRecords:
    """The same records at a smaller `max_length`, without encoding again.

    Exact: labels are computed on the whole text before truncation keeps a prefix, so cutting a
    longer prefix again equals tokenizing at `max_length` (examples left with no trained token
    become None). A larger `max_length` is possible only if no record was cut.
    """
    if max_length == self.max_length:
      return self
    if max_length > self.max_length and (self.full_lengths > self.max_length).any():
      raise ValueError(f"cannot extend a tokenization cut at max_length {self.max_length} to {max_length}")
    if hasattr(self.examples, "with_max_length"):
      examples = self.examples.with_max_length(max_length)
    else:
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


# ---------------------------------------------------------------------------------------------
# The fast path: one render per conversation, reply spans from a per-shape sentinel render.

_SENTINEL = "\ue000jaxsft{}\ue001"  # private-use characters around an index: no template or text has them


@dataclasses.dataclass(frozen=True)
class _ShapePlan:
  """A conversation shape's template text around its contents and, per trained turn, the span
  rule's quantities in sentinel coordinates: `(message index, reply_end, contents_before_reply_end,
  lo, contents_before_lo, from_header, after, marker)`. A real position is the sentinel one plus the
  length change of the contents before it. `lo` is where the reply starts (`from_header`: the end of
  the generation prompt) or where its text is searched from; `after` is the template text after the
  reply when it ends the conversation, and `marker` the end-of-turn marker of a final turn (None for
  earlier turns: it is cut from `after` against the real text that follows)."""

  skeleton: tuple[str, ...]  # len(content_order) + 1 pieces
  content_order: tuple[int, ...]  # message index of each non-empty content, in render order
  turns: tuple[tuple[int, int, int, int, int, bool, str, str | None], ...]
  render: Callable[[list], str]  # the whole conversation, as `_render` renders it


class SpanRenderer:
  """`render_with_spans` with one template render per conversation (see the module docstring).

  Call it with a record; returns `(text, spans)` exactly as `render_with_spans` does, which it
  falls back to for records whose template does not treat contents as opaque text.
  """

  def __init__(self, tokenizer, *, train_on: str = "all_assistant"):
    if train_on not in TRAIN_ON:
      raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    self.tokenizer, self.train_on = tokenizer, train_on
    self.bos = _bos_prefix(tokenizer)
    self.plans: dict[tuple, _ShapePlan | None] = {}
    self.fallbacks = 0  # records that took the reference path (`render_with_spans`)
    self._direct = _direct_renderer(tokenizer)

  def __call__(self, record: dict) -> tuple[str, list[tuple[int, int]]]:
    messages = record["messages"]
    shape = tuple((m["role"], m["content"] == "") for m in messages)
    plan = self.plans.get(shape, False)
    if plan is False:
      plan = self.plans[shape] = self._plan(shape)
    if plan is not None:
      try:
        full = plan.render(messages)
      except Exception:  # the template rejects this record: the reference path raises it as a ValueError
        full = None
      contents = [messages[i]["content"] for i in plan.content_order]
      pieces = [plan.skeleton[0]]
      for content, piece in zip(contents, plan.skeleton[1:]):
        pieces += (content, piece)
      if full == "".join(pieces):
        return self._spans(full, messages, plan, contents)
    self.fallbacks += 1
    return render_with_spans(self.tokenizer, record, train_on=self.train_on)

  def _spans(self, full, messages, plan, contents):
    shift = [0]
    for i, content in zip(plan.content_order, contents):
      shift.append(shift[-1] + len(content) - len(_SENTINEL.format(i)))
    spans = []
    for i, reply_end_s, k_end, lo_s, k_lo, from_header, after, marker in plan.turns:
      reply_end, lo = reply_end_s + shift[k_end], lo_s + shift[k_lo]
      start = lo if from_header else _find_reply(full, messages[i]["content"], lo, reply_end)
      if not 0 <= start < reply_end:
        raise ValueError(f"assistant turn {i}: reply text not found in the rendered conversation")
      if marker is None:
        marker = _end_marker(after, full, reply_end)
      spans.append((start, reply_end + len(marker)))  # the end-of-turn marker is trained
    if self.bos and not full.startswith(self.bos):
      full = self.bos + full
      spans = [(s + len(self.bos), e + len(self.bos)) for s, e in spans]
    return full, spans

  def _plan(self, shape) -> _ShapePlan | None:
    """The shape's sentinel render, or None when positions cannot be mapped (then records of this
    shape take the reference path, which also raises the errors it raises)."""
    sentinels = [_SENTINEL.format(i) for i in range(len(shape))]
    messages = [{"role": role, "content": "" if empty else sentinels[i]} for i, (role, empty) in enumerate(shape)]
    render = lambda msgs, gen=False: _render(self.tokenizer, msgs, generation_prompt=gen)
    try:
      full = render(messages)
    except Exception:  # the template rejects this shape: the reference path raises it with context
      return None
    order = [i for i, (_, empty) in enumerate(shape) if not empty]
    skeleton, at = [], 0
    for i in order:
      pos = full.find(sentinels[i], at)
      if pos < 0 or full.count(sentinels[i]) != 1:
        return None
      skeleton.append(full[at:pos])
      at = pos + len(sentinels[i])
    skeleton.append(full[at:])
    ends = []  # sentinel (start, end) positions, in render order
    pos = 0
    for piece, i in zip(skeleton, order):
      pos += len(piece)
      ends.append((pos, pos + len(sentinels[i])))
      pos += len(sentinels[i])

    def contents_before(p):  # how many contents end at or before p; None if p falls inside one
      k = 0
      for lo, hi in ends:
        if hi <= p:
          k += 1
        elif lo < p:
          return None
      return k

    turns_wanted = [i for i, (role, _) in enumerate(shape) if role == "assistant"]
    if self.train_on == "last":
      turns_wanted = turns_wanted[-1:]
    turns = []
    for i in turns_wanted:
      if i not in order:  # an empty reply: the reference path raises
        return None
      k = order.index(i)
      reply_end = ends[k][1]
      header = render(messages[:i], True) if i else ""
      from_header = bool(i) and full.startswith(header) and len(header) < reply_end
      if from_header:
        lo = len(header)
      else:
        before = render(messages[:i]) if i else ""
        if not full.startswith(before):
          return None
        lo = len(before)
      k_lo = contents_before(lo)
      last = render(messages[: i + 1])
      if k_lo is None or last.count(sentinels[i]) != 1:
        return None
      after = last[last.index(sentinels[i]) + len(sentinels[i]):]
      if "\ue000" in after:  # contents after the reply: not template text alone
        return None
      marker = None
      if i + 1 == len(messages):
        following = _following_turn(render, messages, sentinels[i])
        marker = _end_marker(after, after if following is None else following)
      turns.append((i, reply_end, k + 1, lo, k_lo, from_header, after, marker))
    render_full = lambda msgs: _render(self.tokenizer, msgs)
    if self._direct is not None and self._direct(messages) == full:
      render_full = self._direct
    return _ShapePlan(tuple(skeleton), tuple(order), tuple(turns), render_full)


def _direct_renderer(tokenizer) -> Callable[[list], str] | None:
  """The compiled chat template called directly, without `apply_chat_template`'s per-call
  preparation (half the render time for short records); None where transformers does not expose
  its compiled template. Used for a conversation shape only after it rendered that shape's
  sentinel conversation exactly as `apply_chat_template` does."""
  try:
    from transformers.utils.chat_template_utils import _compile_jinja_template
  except ImportError:
    return None
  template = getattr(tokenizer, "chat_template", None)
  try:
    compiled = _compile_jinja_template(template if template else PLAIN_CHAT_TEMPLATE)
    variables = dict(tokenizer.special_tokens_map)
  except Exception:  # a template only apply_chat_template can handle
    return None
  if not isinstance(template, (str, type(None))):
    return None
  return lambda messages: compiled.render(messages=messages, tools=None, documents=None, add_generation_prompt=False,
                                          **variables)


def _contiguous_offsets(backend) -> bool:
  """True when every token covers >= 1 character and offsets never decrease: byte-level BPE with
  no normalizer and no post-processor that trims offsets."""
  try:
    spec = json.loads(backend.to_str())
  except (AttributeError, TypeError, ValueError):  # not a `tokenizers.Tokenizer`: the offsets decide
    return False
  pre, post = spec.get("pre_tokenizer") or {}, spec.get("post_processor") or {}
  pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
  posts = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
  byte_level = any(p.get("type") == "ByteLevel" for p in pres)
  trims = any(p.get("type") in ("ByteLevel", "RobertaProcessing") and p.get("trim_offsets", True) for p in posts)
  return (spec.get("normalizer") is None and byte_level and not trims
          and (spec.get("model") or {}).get("type") == "BPE")


def _trained_runs(enc, spans, num_tokens: int) -> list[tuple[int, int]] | None:
  """Token ranges [a, b) overlapping each span, from `char_to_token` (contiguous offsets only);
  None when a boundary character maps to no token (then the offsets decide)."""
  runs = []
  for s, e in spans:
    a, b = enc.char_to_token(s), enc.char_to_token(e - 1)
    if a is None or b is None:
      return None
    while a > 0 and enc.token_to_chars(a - 1)[1] > s:
      a -= 1
    while b + 1 < num_tokens and enc.token_to_chars(b + 1)[0] < e:
      b += 1
    runs.append((a, b + 1))
  return runs


@dataclasses.dataclass
class EncodedBatch:
  """Consecutive records encoded: the kept examples' tokens back to back.

  `token_ids` int32[T] and `trained` bool[T] (labels = token_ids where trained, else -100) hold the
  kept examples' first `max_length` tokens in record order; per record `lengths` (0 when dropped:
  no trained token left), `full_lengths` (before truncation) and `first_trained` (index of the
  first trained token, -1 when dropped), all int64.
  """

  token_ids: np.ndarray
  trained: np.ndarray
  lengths: np.ndarray
  full_lengths: np.ndarray
  first_trained: np.ndarray

  def examples(self) -> list[dict | None]:
    out, at = [], 0
    for n in self.lengths.tolist():
      if n == 0:
        out.append(None)
        continue
      ids = self.token_ids[at:at + n]
      out.append({"input_ids": ids, "labels": np.where(self.trained[at:at + n], ids, IGNORE_INDEX).astype(np.int32)})
      at += n
    return out


Rendered = tuple[dict, str, list[tuple[int, int]]]  # (record, text, spans) as `SpanRenderer` gives them


def encode_batches(tokenizer, records: Iterable[dict], *, max_length: int, train_on: str = "all_assistant",
                   batch_size: int = 512, first_index: int = 0) -> Iterator[EncodedBatch]:
  """`tokenize_example` over a stream of records, `batch_size` at a time, as `EncodedBatch`es.

  The Rust tokenizer's `encode_batch` runs on a thread (it releases the GIL and uses its own
  threads where `TOKENIZERS_PARALLELISM` allows) while this thread renders the next batch and
  computes the labels of the previous one; at most three batches are held at once. A record the
  template cannot label raises `DataError` (see the module docstring); `first_index` is the index
  of the first record, for records that do not know where they were read.
  """
  renderer = SpanRenderer(tokenizer, train_on=train_on)

  def rendered():
    for index, record in enumerate(records, first_index):
      try:
        text, spans = renderer(record)
      except ValueError as e:
        raise _record_error(e, record, index) from None
      yield record, text, spans

  yield from encode_rendered(tokenizer, rendered(), max_length=max_length, batch_size=batch_size,
                             first_index=first_index)


def encode_rendered(tokenizer, rendered: Iterable[Rendered], *, max_length: int, batch_size: int = 512,
                    first_index: int = 0) -> Iterator[EncodedBatch]:
  """`encode_batches` of records already rendered: `(record, text, spans)` items, from
  `iter_rendered` (the record only names a failure to label it)."""
  backend = _backend(tokenizer)
  contiguous = _contiguous_offsets(backend)

  def rendered_batches():
    batch = []
    for item in rendered:
      batch.append(item)
      if len(batch) == batch_size:
        yield batch
        batch = []
    if batch:
      yield batch

  encode = lambda batch: backend.encode_batch([text for _, text, _ in batch], add_special_tokens=False)
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    pending = None  # (future of encodings, the batch, index of its first record)
    start = first_index
    for batch in rendered_batches():
      submitted = (pool.submit(encode, batch), batch, start)
      start += len(batch)
      if pending is not None:
        yield _labels_batch(pending[0].result(), pending[1], pending[2], max_length, contiguous)
      pending = submitted
    if pending is not None:
      yield _labels_batch(pending[0].result(), pending[1], pending[2], max_length, contiguous)


def iter_rendered(tokenizer, path, *, train_on: str = "all_assistant", **load) -> Iterator[Rendered]:
  """`records.iter_records(path, **load)` with each record rendered (`SpanRenderer`) as it is read,
  as `(record, text, spans)`: a record the chat template cannot label is a bad record like the
  loader's own, raised as `DataError` naming its file and line, or skipped and reported."""
  renderer = SpanRenderer(tokenizer, train_on=train_on)
  out = None

  def check(record):
    nonlocal out
    out = renderer(record)

  for record in iter_records(path, check=check, **load):
    yield record, *out


def _labels_batch(encodings, batch: list[Rendered], first_index: int, max_length: int,
                  contiguous: bool) -> EncodedBatch:
  n = len(encodings)
  lengths, full_lengths = np.zeros(n, np.int64), np.zeros(n, np.int64)
  first_trained = np.full(n, -1, np.int64)
  ids_out = array.array("i")
  runs_out = []  # (flat offset, a, b) trained token ranges of kept examples
  for j, (enc, (record, _, spans)) in enumerate(zip(encodings, batch)):
    ids = enc.ids
    full = full_lengths[j] = len(ids)
    runs = _trained_runs(enc, spans, full) if contiguous else None
    if runs is None:
      labels = _labels_or_raise(ids, enc.offsets, spans, record, first_index + j)
      trained = np.flatnonzero(labels != IGNORE_INDEX)
      runs = _runs_of(trained)
    keep = min(full, max_length)
    kept_runs = [(a, min(b, keep)) for a, b in runs if a < keep]
    if not kept_runs:
      continue
    base = len(ids_out)
    ids_out.extend(ids[:keep])
    lengths[j], first_trained[j] = keep, min(a for a, _ in kept_runs)
    runs_out += [(base + a, base + b) for a, b in kept_runs]
  token_ids = np.frombuffer(ids_out, dtype=np.int32) if len(ids_out) else np.zeros(0, np.int32)
  trained = np.zeros(len(token_ids), dtype=bool)
  for a, b in runs_out:
    trained[a:b] = True
  return EncodedBatch(token_ids, trained, lengths, full_lengths, first_trained)


def _labels_or_raise(ids, offsets, spans, record, index: int) -> np.ndarray:
  try:
    return _labels_from_offsets(np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64).reshape(-1, 2),
                                spans)
  except ValueError as e:
    raise _record_error(e, record, index) from None


def _runs_of(positions: np.ndarray) -> list[tuple[int, int]]:
  """Sorted positions -> maximal [a, b) runs of consecutive positions."""
  if not len(positions):
    return []
  breaks = np.flatnonzero(np.diff(positions) != 1)
  starts = np.concatenate([[positions[0]], positions[breaks + 1]])
  ends = np.concatenate([positions[breaks], [positions[-1]]]) + 1
  return list(zip(starts.tolist(), ends.tolist()))


def tokenize_records(tokenizer, records: Sequence[dict], *, max_length: int, train_on: str = "all_assistant",
                     batch_size: int = 512) -> TokenizedRecords:
  """`tokenize_example` over many records, through `encode_batches` (one template render per
  record, `batch_size` texts per `encode_batch` call).

  Returns:
    A `TokenizedRecords` (the examples and their lengths before truncation), to pass to
    `make_batches`, `batch_shapes` and `count_batches` so that none of them tokenizes again.
  """
  batches = encode_batches(tokenizer, records, max_length=max_length, train_on=train_on, batch_size=batch_size)
  return _collect(batches, max_length, train_on)


def tokenize_file(tokenizer, path, *, max_length: int, train_on: str = "all_assistant", fmt: str = "auto",
                  field_map: dict | None = None, on_error: str = "raise", report: SkipReport | None = None,
                  batch_size: int = 512) -> tuple[list[dict], TokenizedRecords]:
  """`load_records` then `tokenize_records` in one pass, each record rendered once.

  A record the chat template cannot label is one more bad record for the loader: it raises
  `DataError` naming the file and line, or with `on_error="skip"` is left out and counted in
  `report` (so the records returned all tokenize).
  """
  records = []

  def kept():
    for item in iter_rendered(tokenizer, path, train_on=train_on, fmt=fmt, field_map=field_map, on_error=on_error,
                              report=report):
      records.append(item[0])
      yield item

  tokenized = _collect(encode_rendered(tokenizer, kept(), max_length=max_length, batch_size=batch_size), max_length,
                       train_on)
  return records, tokenized


def _collect(batches: Iterable[EncodedBatch], max_length: int, train_on: str) -> TokenizedRecords:
  examples: list[dict | None] = []
  full_lengths = []
  for batch in batches:
    examples += batch.examples()
    full_lengths.append(batch.full_lengths)
  full = np.concatenate(full_lengths) if full_lengths else np.zeros(0, np.int64)
  return TokenizedRecords(examples, full, max_length, train_on)
