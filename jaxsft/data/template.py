"""Chat templates: a conversation rendered as text, and the reply-span rule (which characters train).

`render_chat` renders messages with the tokenizer's chat template (`apply_chat_template(...,
tokenize=False)`), or `PLAIN_CHAT_TEMPLATE` for tokenizers without one. A record
`{"messages": [...]}` is rendered into F, the whole conversation. The trained characters of
assistant turn i are located in F itself: a template may render a turn differently once later
turns follow (Qwen3 gives only the turn after the last user query a think block), so renders of a
part of the conversation are used only for what comes before the turn and for the template text
after a reply:

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

The rule is written once (`locate_reply`, `ReplyRule`, `text_after_reply`, `final_marker`); both paths
below apply it.

Reasoning templates: the labels follow F. Qwen3 renders the turn after the last user query as
`<think>\\n{reasoning}\\n</think>\\n\\n{reply}` (the reasoning from `reasoning_content` or from a
reply written as `<think>...</think>...`, else empty) and all of it is trained, as its generation
prompt does not contain the block; earlier turns render without their reasoning, and only what is
rendered is trained. SmolLM3 in /think mode (the default) renders replies as written, a
`<think>...</think>` included, and trains them; with /no_think in the system message its
generation prompt ends with the empty `<think>\\n\\n</think>\\n` block, which is then prompt.

Labels are never derived from comparing ids with the pad or eos id (SmolLM2's pad == eos ==
`<|im_end|>`): a token is trained when its character span overlaps a trained span (tokenize.py).

`PLAIN_CHAT_TEMPLATE`, for tokenizers without a chat template:

    {system}\\n\\n                      (if any)
    User: {user}\\n\\n
    Assistant: {reply}{eos_token}\\n\\n

with generation prompt `Assistant: `. The rendered text is tokenized with
`add_special_tokens=False` (templates already contain their special tokens, so there is no double
BOS); a tokenizer that adds a BOS by default gets its BOS text (`bos_prefix`) prepended once when
the rendered text does not already start with it.

Two paths: `render_with_spans` (the reference) costs three or four template renders per
assistant turn. `SpanRenderer` (the fast path) renders each conversation *shape* (the roles,
which contents are empty and which replies a weight of 0 leaves untrained) once with unique sentinel strings in place of the contents, and applies
the rule to that render: it gives the template text around every content and, in sentinel
coordinates, every quantity the rule needs (where each generation prompt and each reply end, the
template text after a reply). A conversation is then rendered once, and the fast path is taken
only if that text equals the sentinel skeleton with the contents put back (the template treats the
contents as opaque text); the positions are then mapped from sentinel to real coordinates (the
marker of a turn that is not the last is cut against the real text that follows it). Otherwise (a
template that trims, escapes or branches on content) the record takes the reference path. Where
the template's source proves it content-opaque (template_opacity.py: contents only written out,
truth-tested or type-tested), a conversation is not rendered at all: its text is the skeleton with
the contents put back, which is what the render would give.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable

from jaxsft.config_checks import TRAIN_ON  # the config's list of choices (data.train_on)
from jaxsft.data.records import DataError
from jaxsft.data.template_opacity import contents_opaque
from jaxsft.errors import one_line

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + (eos_token or '') + '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")

Spans = list[tuple[int, int]]


def as_trained(tokenizer):
  """The tokenizer to write beside a tuned model: `tokenizer` itself, or where it has no chat
  template a copy carrying `PLAIN_CHAT_TEMPLATE`, the one its records were rendered with, so that
  `apply_chat_template` on the saved tokenizer formats a prompt as the training text was."""
  if getattr(tokenizer, "chat_template", None):
    return tokenizer
  import copy

  tokenizer = copy.copy(tokenizer)
  tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
  return tokenizer


def render_chat(tokenizer, messages, *, generation_prompt: bool = False) -> str:
  """`messages` rendered as text with the tokenizer's chat template (`PLAIN_CHAT_TEMPLATE` when it
  has none); a conversation the template's `raise_exception` (or jinja's sandbox) refuses, or a
  template that does not compile, raises `DataError` naming the tokenizer's folder."""
  import jinja2

  try:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt,
        chat_template=None if getattr(tokenizer, "chat_template", None) else PLAIN_CHAT_TEMPLATE)
  except jinja2.TemplateSyntaxError as e:
    raise DataError(f"the chat template of {_template_source(tokenizer)} does not compile: line {e.lineno}: "
                    f"{one_line(e.message or e)}") from None
  except Exception as e:
    if _template_rejects(e):
      raise DataError(f"the chat template rejects the conversation: {one_line(e)} (the template of "
                      f"{_template_source(tokenizer)})") from None
    raise


def _template_source(tokenizer) -> str:
  """Where the tokenizer (and so its chat template) was loaded from, for an error line."""
  return getattr(tokenizer, "name_or_path", None) or "the tokenizer"


def _template_rejects(e: Exception) -> bool:
  """A template's `raise_exception` (a conversation it refuses, e.g. roles that do not alternate),
  not a template that does not compile."""
  import jinja2

  return isinstance(e, jinja2.TemplateError) and not isinstance(e, jinja2.TemplateSyntaxError)


# Per tokenizer object; weak keys, so a tokenizer is not kept alive (nor changed) by its entry.
_BOS_PREFIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bos_prefix(tokenizer) -> str:
  """The BOS text to prepend by hand: non-empty only if the tokenizer adds a BOS by default."""
  try:
    return _BOS_PREFIXES[tokenizer]
  except (KeyError, TypeError):  # TypeError: a tokenizer that cannot be a weak key is asked every time
    pass
  bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
  prefix = ""
  if bos and bos_id is not None:
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    prefix = bos if ids and ids[0] == bos_id else ""
  try:
    _BOS_PREFIXES[tokenizer] = prefix
  except TypeError:
    pass
  return prefix


def _with_bos(full: str, spans: Spans, bos: str) -> tuple[str, Spans]:
  if bos and not full.startswith(bos):
    return bos + full, [(s + len(bos), e + len(bos)) for s, e in spans]
  return full, spans


def _shape(messages) -> tuple[tuple[str, bool, bool], ...]:
  """Per turn: its role, whether its content is empty, whether a `weight` of 0 leaves it untrained."""
  return tuple((m["role"], m["content"] == "", m.get("weight") == 0) for m in messages)


def _trained_turns(shape, train_on: str) -> list[int]:
  """The turns of a `_shape` whose replies are trained: the assistant turns but those of weight
  0, or with train_on="last" the final one of them."""
  turns = [i for i, (role, _, weighted_out) in enumerate(shape) if role == "assistant" and not weighted_out]
  return turns[-1:] if train_on == "last" else turns


def _check_train_on(train_on: str) -> None:
  if train_on not in TRAIN_ON:
    raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")


# ---------------------------------------------------------------------------------------------
# The reply-span rule.

# Private-use sentinels (like `_SENTINEL` below) for the reply being located and for a turn appended after it.
_PROBE, _NEXT_PROBE = "\ue000jaxsft-reply\ue001", "\ue000jaxsft-next\ue001"

Render = Callable[..., str]  # render(messages, generation_prompt=False) -> text


class ReplyNotLocated(ValueError):
  """The rule cannot place a reply in the render (see `locate_reply`)."""


@dataclasses.dataclass(frozen=True)
class ReplyRule:
  """Assistant turn `turn`'s quantities under the rule, in the coordinates of the render `full`
  they were located in: `lo` is where the reply starts (`from_header`: the end of the generation
  prompt) or where its text is searched from; `after` is the template text after the reply when
  it ends the conversation, `marker` the end-of-turn marker of a final turn (None for earlier
  turns: it is cut from `after` against the text that follows the reply in the full render).
  The `*_shift` arguments map the positions onto a render whose contents have other lengths."""

  turn: int
  reply_end: int
  lo: int
  from_header: bool
  after: str = ""
  marker: str | None = None

  def start(self, full: str, content: str, lo_shift: int = 0, end_shift: int = 0) -> int:
    """Where the reply starts in `full`; ReplyNotLocated when its text is not there."""
    reply_end, lo = self.reply_end + end_shift, self.lo + lo_shift
    start = lo if self.from_header else _find_reply(full, content, lo, reply_end)
    if not 0 <= start < reply_end:
      raise ReplyNotLocated(f"assistant turn {self.turn}: reply text not found in the rendered conversation")
    return start

  def end(self, full: str, end_shift: int = 0) -> int:
    """Where the trained span ends in `full`: after the reply and its end-of-turn marker."""
    reply_end = self.reply_end + end_shift
    marker = self.marker if self.marker is not None else _end_marker(self.after, full, reply_end)
    return reply_end + len(marker)

  def span(self, full: str, content: str, lo_shift: int = 0, end_shift: int = 0) -> tuple[int, int]:
    return self.start(full, content, lo_shift, end_shift), self.end(full, end_shift)


def probe_turn(messages: list, i: int, probe: str) -> list:
  """The conversation with turn i's text replaced by `probe`."""
  return messages[:i] + [{**messages[i], "content": probe}] + messages[i + 1:]


def locate_reply(render: Render, messages: list, full: str, i: int, probe: str) -> ReplyRule:
  """Where assistant turn i's reply ends in `full` (the render of `messages`) and where it starts
  or is searched from (`after` and `marker` are left to `text_after_reply`/`final_marker`).
  `probe` is a string no template or text contains (it may be turn i's own text).

  Raises ReplyNotLocated when the rule cannot place the reply: an empty reply, a template that
  drops or repeats it, renders the rest of the conversation differently depending on its text,
  or renders the turns before it differently once it follows."""
  content = messages[i]["content"]
  if not content:
    raise ReplyNotLocated(f"assistant turn {i}: reply text not found in the rendered conversation")
  text = render(probe_turn(messages, i, probe))
  if text.count(probe) != 1:
    raise ReplyNotLocated(f"assistant turn {i}: the chat template does not render the reply exactly once")
  tail = text[text.index(probe) + len(probe):]
  if not full.endswith(tail):
    raise ReplyNotLocated(f"assistant turn {i}: the chat template renders the rest of the conversation "
                          "differently depending on the reply's text; cannot locate the reply span")
  reply_end = len(full) - len(tail)
  header = render(messages[:i], True) if i else ""
  if i and full.startswith(header) and len(header) < reply_end:
    return ReplyRule(i, reply_end, len(header), True)  # everything after the generation prompt is the model's
  before = render(messages[:i]) if i else ""
  if not full.startswith(before):
    raise ReplyNotLocated(f"chat template renders turns 0..{i - 1} differently once later turns follow; "
                          "cannot locate the reply span")
  return ReplyRule(i, reply_end, len(before), False)


def text_after_reply(render: Render, probed: list, i: int, probe: str) -> str | None:
  """What the template renders after turn i's reply (the text `probe` in `probed`) when it ends
  the conversation; None when the render does not hold the probe exactly once."""
  last = render(probed[: i + 1])
  return last[last.index(probe) + len(probe):] if last.count(probe) == 1 else None


def final_marker(render: Render, probed: list, after: str, probe: str) -> str:
  """The end-of-turn marker of the final reply (the text `probe` in `probed`), `after` being what
  the template renders after it."""
  following = _following_turn(render, probed, probe)
  return _end_marker(after, after if following is None else following)


def _find_reply(text: str, content: str, lo: int, hi: int) -> int:
  """Where `content` (or, for templates that trim it, its stripped text) starts in text[lo:hi]; -1 if nowhere."""
  start = text.find(content, lo, hi)
  if start < 0 and content.strip():
    start = text.find(content.strip(), lo, hi)
  return start


def _following_turn(render: Render, messages: list, reply: str) -> str | None:
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


# ---------------------------------------------------------------------------------------------
# The reference path: the rule on the conversation itself.


def render_with_spans(tokenizer, record: dict, *, train_on: str = "all_assistant") -> tuple[str, Spans]:
  """The rendered conversation and the character spans `[start, end)` to train (the rule in the
  module docstring).

  Raises ValueError when a reply cannot be located in the rendered text (a template that drops or
  repeats the reply, renders the rest of the conversation differently depending on the reply's
  text, or renders the turns before it differently once it follows).
  """
  _check_train_on(train_on)
  messages = record["messages"]
  render = lambda msgs, gen=False: render_chat(tokenizer, msgs, generation_prompt=gen)
  full = render(messages)
  spans = []
  for i in _trained_turns(_shape(messages), train_on):
    rule = locate_reply(render, messages, full, i, _PROBE)
    start = rule.start(full, messages[i]["content"])
    probed = probe_turn(messages, i, _PROBE)
    after = text_after_reply(render, probed, i, _PROBE) or ""
    marker = final_marker(render, probed, after, _PROBE) if i + 1 == len(messages) else None
    spans.append((start, dataclasses.replace(rule, after=after, marker=marker).end(full)))
  return _with_bos(full, spans, bos_prefix(tokenizer))


# ---------------------------------------------------------------------------------------------
# The fast path: one render per conversation, the rule applied once per conversation shape.

_SENTINEL = "\ue000jaxsft{}\ue001"  # private-use characters around an index: no template or text has them


@dataclasses.dataclass(frozen=True)
class _ShapePlan:
  """A conversation shape's template text around its contents and, per trained turn, its
  `ReplyRule` in sentinel coordinates with how many contents end before its `reply_end` and
  before its `lo`: a real position is the sentinel one plus the length change of those contents."""

  skeleton: tuple[str, ...]  # len(content_order) + 1 pieces
  content_order: tuple[int, ...]  # message index of each non-empty content, in render order
  turns: tuple[tuple[ReplyRule, int, int], ...]
  render: Callable[[list], str]  # the whole conversation, as `render_chat` renders it


class SpanRenderer:
  """`render_with_spans` with one template render per conversation (see the module docstring).

  Call it with a record; returns `(text, spans)` exactly as `render_with_spans` does, which it
  falls back to for records whose template does not treat contents as opaque text.
  """

  def __init__(self, tokenizer, *, train_on: str = "all_assistant"):
    _check_train_on(train_on)
    self.tokenizer, self.train_on = tokenizer, train_on
    self.bos = bos_prefix(tokenizer)
    self.plans: dict[tuple, _ShapePlan | None] = {}
    self.fallbacks = 0  # records that took the reference path (`render_with_spans`)
    self._direct, self.opaque = _direct_renderer(tokenizer)

  def __call__(self, record: dict) -> tuple[str, Spans]:
    messages = record["messages"]
    shape = _shape(messages)
    plan = self.plans.get(shape, False)
    if plan is False:
      plan = self.plans[shape] = self._plan(shape)
    if plan is not None:
      contents = [messages[i]["content"] for i in plan.content_order]
      pieces = [plan.skeleton[0]]
      for content, piece in zip(contents, plan.skeleton[1:]):
        pieces += (content, piece)
      if self.opaque and all(isinstance(c, str) for c in contents):  # the render would be this text
        return self._spans("".join(pieces), messages, plan, contents)
      try:
        full = plan.render(messages)
      except Exception:  # the template rejects this record: the reference path raises it as a ValueError
        full = None
      if full == "".join(pieces):
        return self._spans(full, messages, plan, contents)
    self.fallbacks += 1
    return render_with_spans(self.tokenizer, record, train_on=self.train_on)

  def _spans(self, full, messages, plan, contents):
    shift = [0]
    for i, content in zip(plan.content_order, contents):
      shift.append(shift[-1] + len(content) - len(_SENTINEL.format(i)))
    spans = [rule.span(full, messages[rule.turn]["content"], shift[k_lo], shift[k_end])
             for rule, k_end, k_lo in plan.turns]
    return _with_bos(full, spans, self.bos)

  def _plan(self, shape) -> _ShapePlan | None:
    """The shape's sentinel render, or None when positions cannot be mapped (then records of this
    shape take the reference path, which also raises the errors it raises)."""
    sentinels = [_SENTINEL.format(i) for i in range(len(shape))]
    messages = [{"role": role, "content": "" if empty else sentinels[i]} for i, (role, empty, _) in enumerate(shape)]
    render = lambda msgs, gen=False: render_chat(self.tokenizer, msgs, generation_prompt=gen)
    try:
      full = render(messages)
    except Exception:  # the template rejects this shape: the reference path raises it with context
      return None
    order = [i for i, (_, empty, _) in enumerate(shape) if not empty]
    ends = _sentinel_ends(full, [sentinels[i] for i in order])
    if ends is None:
      return None
    turns = []
    for i in _trained_turns(shape, self.train_on):
      turn = self._plan_turn(render, messages, full, i, ends)
      if turn is None:
        return None
      turns.append(turn)
    skeleton = [full[a:b] for a, b in zip([0] + [hi for _, hi in ends], [lo for lo, _ in ends] + [len(full)])]
    render_full = lambda msgs: render_chat(self.tokenizer, msgs)
    if self._direct is not None and self._direct(messages) == full:
      render_full = self._direct
    return _ShapePlan(tuple(skeleton), tuple(order), tuple(turns), render_full)

  def _plan_turn(self, render, messages, full, i, ends) -> tuple[ReplyRule, int, int] | None:
    """Turn i's rule in the sentinel render `full` with the content counts that map it; None
    where a position falls inside a content or the text after the reply is not template text."""
    try:
      rule = locate_reply(render, messages, full, i, messages[i]["content"])
    except ReplyNotLocated:  # an empty reply or a misplaced one: the reference path raises
      return None
    k_lo = _contents_before(ends, rule.lo)
    after = text_after_reply(render, messages, i, messages[i]["content"])
    if k_lo is None or after is None or "\ue000" in after:  # "\ue000" after the reply: not template text alone
      return None
    marker = final_marker(render, messages, after, messages[i]["content"]) if i + 1 == len(messages) else None
    return dataclasses.replace(rule, after=after, marker=marker), _contents_before(ends, rule.reply_end), k_lo


def _sentinel_ends(full: str, sentinels: list[str]) -> list[tuple[int, int]] | None:
  """The (start, end) of each sentinel in `full`, in render order; None unless each occurs exactly
  once, in that order."""
  ends, at = [], 0
  for sentinel in sentinels:
    pos = full.find(sentinel, at)
    if pos < 0 or full.count(sentinel) != 1:
      return None
    ends.append((pos, pos + len(sentinel)))
    at = pos + len(sentinel)
  return ends


def _contents_before(ends: list[tuple[int, int]], p: int) -> int | None:
  """How many contents end at or before p; None if p falls inside one."""
  k = 0
  for lo, hi in ends:
    if hi <= p:
      k += 1
    elif lo < p:
      return None
  return k


def _direct_renderer(tokenizer) -> tuple[Callable[[list], str] | None, bool]:
  """(the compiled chat template called directly, without `apply_chat_template`'s per-call
  preparation (half the render time for short records), whether the template is proved
  content-opaque (`template_opacity`)); (None, False) where transformers does not expose its
  compiled template. The renderer is used for a conversation shape only after it rendered that
  shape's sentinel conversation exactly as `apply_chat_template` does."""
  try:
    from transformers.utils.chat_template_utils import _compile_jinja_template
  except ImportError:
    return None, False
  template = getattr(tokenizer, "chat_template", None)
  if not isinstance(template, (str, type(None))):
    return None, False
  source = template if template else PLAIN_CHAT_TEMPLATE
  try:
    compiled = _compile_jinja_template(source)
    variables = dict(tokenizer.special_tokens_map)
  except Exception:  # a template only apply_chat_template can handle
    return None, False
  render = lambda messages: compiled.render(messages=messages, tools=None, documents=None, add_generation_prompt=False,
                                            **variables)
  return render, contents_opaque(source, compiled.environment)
