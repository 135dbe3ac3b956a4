"""Content-opaque chat templates: the proof on the template's tree (template_opacity.py) accepts the
templates whose render is their shape's skeleton with the contents put back, refuses every
template that reads a content another way, and SpanRenderer then gives the reference spans
without rendering a record."""

import copy
import dataclasses
import pathlib
import random

import pytest

from jaxsft.data import SpanRenderer, render_with_spans
from jaxsft.data.template import PLAIN_CHAT_TEMPLATE
from jaxsft.data.template_opacity import contents_opaque

TEMPLATES = pathlib.Path(__file__).parent / "fixtures" / "chat_templates"

LOOP = "{% for message in messages %}{BODY}{% endfor %}{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"


def opaque(source: str) -> bool:
  from transformers.utils.chat_template_utils import _compile_jinja_template

  return contents_opaque(source, _compile_jinja_template("").environment)  # transformers' environment


def looped(body: str) -> str:
  """`body` for every message, after a `<role>` header (the generation prompt's form)."""
  return LOOP.replace("{BODY}", "{{ '<' + message['role'] + '>' }}" + body)


PROVED = {
    "written": looped("{{ message['role'] + ': ' + message['content'] + '\\n' }}"),
    "attribute and ~": looped("{{ message.role ~ ': ' ~ message.content }}{{ '\\n' }}"),
    "emptiness branch": looped("{% if message['content'] %}{{ message['content'] }}{% else %}{{ '(empty)' }}{% endif %}"
                               "{{ '|' }}"),
    "not and type test": looped("{% if not message['content'] or message['content'] is not string %}{{ '-' }}"
                                "{% else %}{{ '<' + message['content'] + '>' }}{% endif %}"),
    "first message by index": ("{% if messages[0]['role'] != 'system' %}{{ 'SYS\\n' }}{% endif %}"
                               + looped("{{ message['content'] }}{{ '.' }}")),
    "count of messages": "{% if messages | length > 9 %}{{ 'long' }}{% endif %}" + looped("{{ message['content'] }}"),
    "conditional expression": looped("{{ ('[' if message['content'] else '(') + message['role'] + ']' }}"
                                     "{{ message['content'] }}"),
}

REFUSED = {
    "trim filter": looped("{{ message['content'] | trim }}"),
    "method": looped("{{ message['content'].strip() }}"),
    "membership": looped("{% if 'x' in message['content'] %}{{ 'X' }}{% endif %}{{ message['content'] }}"),
    "comparison": looped("{% if message['content'] == 'a' %}{{ 'A' }}{% endif %}{{ message['content'] }}"),
    "set": looped("{% set c = message['content'] %}{{ c }}"),
    "indexing": looped("{{ message['content'][0] }}"),
    "length": looped("{{ message['content'] | length }}"),
    "value of or": looped("{{ message['content'] or 'none' }}"),
    "other key": looped("{{ message.get('content') }}"),
    "whole message": looped("{{ message }}"),
    "messages aliased": "{% set loop_messages = messages %}" + looped("{{ message['content'] }}"),
    "messages sliced": "{% for message in messages[1:] %}{{ message['content'] }}{% endfor %}",
    "messages filtered": "{% for message in messages | selectattr('role') %}{{ message['content'] }}{% endfor %}",
    "messages to json": "{{ messages | tojson }}",
    "loop filter": "{% for message in messages if message['content'] %}{{ message['content'] }}{% endfor %}",
    "previous item": looped("{{ message['content'] }}{% if loop.previtem %}{{ loop.previtem['role'] }}{% endif %}"),
    "filter block": "{% filter upper %}" + looped("{{ message['content'] }}") + "{% endfilter %}",
    "captured": "{% set text %}" + looped("{{ message['content'] }}") + "{% endset %}{{ text | trim }}",
    "macro": "{% macro show(c) %}{{ c | trim }}{% endmacro %}" + looped("{{ show(message['content']) }}"),
    "loop name rebound": looped("{% set message = {'content': 'x'} %}{{ message['content'] }}"),
    "raise with content": looped("{% if not message['content'] %}{{ raise_exception(message['content']) }}{% endif %}"
                                 "{{ message['content'] }}"),
    "not parseable": "{% for message in messages %}{{ message['content'] }}",
}


@pytest.mark.parametrize("name", sorted(PROVED))
def test_proved_templates(name):
  assert opaque(PROVED[name])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_templates(name):
  assert not opaque(REFUSED[name])


def test_real_templates(tokenizer):
  """ChatML (SmolLM2), the plain template, Phi-3 and OLMo 2 write contents as they are; Gemma 3
  trims them, Qwen3 looks for `<think>` in them and SmolLM3 for `/think` in the system message."""
  assert opaque(tokenizer.chat_template) and opaque(PLAIN_CHAT_TEMPLATE)
  results = {name: opaque((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"))
             for name in ("phi3", "olmo2", "gemma3", "qwen3", "smollm3")}
  assert results == {"phi3": True, "olmo2": True, "gemma3": False, "qwen3": False, "smollm3": False}


AWKWARD = ["", "x", " padded \n", "{{ messages }}", "{% endfor %}", "\ue000jaxsft0\ue001", "<|im_end|>",
           "'quoted' \"both\"", "\\n literal", "🙂 你好", "<assistant>", "\n\n"]


def records(seed: int, count: int) -> list[dict]:
  rng = random.Random(seed)
  out = []
  for _ in range(count):
    messages = [{"role": "system", "content": rng.choice(AWKWARD)}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
      reply = rng.choice([c for c in AWKWARD if c.strip()]) + rng.choice(AWKWARD)
      messages += [{"role": "user", "content": rng.choice(AWKWARD)}, {"role": "assistant", "content": reply}]
    out.append({"messages": messages})
  return out


@pytest.mark.parametrize("name", ["smollm2", "written", "emptiness branch", "not and type test", "first message by index"])
def test_proved_template_spans_without_rendering(tokenizer, name):
  """Each record's (text, spans) equals the reference (`render_with_spans`, which renders with
  `apply_chat_template`), though the renderer renders each shape only once: after a shape's
  first record its plan's render raises."""
  tok = copy.deepcopy(tokenizer)
  if name != "smollm2":
    tok.chat_template = PROVED[name]
  renderer = SpanRenderer(tok)
  assert renderer.opaque

  def no_render(messages):
    raise AssertionError("a proved template's record was rendered")

  for record in records(seed=len(name), count=150):
    expected = render_with_spans(tok, record)
    assert renderer(record) == expected
    renderer.plans = {shape: plan and dataclasses.replace(plan, render=no_render) for shape, plan in renderer.plans.items()}
  assert renderer.fallbacks == 0


def test_refused_template_renders_each_record(tokenizer):
  """A template that branches on a content's characters is not proved: each record is rendered,
  and the records whose branch differs from their shape's sentinel render take the reference
  path, with the reference spans."""
  tok = copy.deepcopy(tokenizer)
  tok.chat_template = looped("{% if 'q' in message['content'] %}{{ '[q]' }}{% endif %}{{ message['content'] + '\\n' }}")
  renderer = SpanRenderer(tok)
  assert not renderer.opaque
  batch = records(seed=7, count=80)
  for record in batch:
    assert renderer(record) == render_with_spans(tok, record)
  with_q = sum(any("q" in m["content"] for m in r["messages"]) for r in batch)
  assert 0 < with_q < len(batch) and renderer.fallbacks == with_q
