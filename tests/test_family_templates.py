"""Label masking with the real chat templates of Qwen3, Gemma 3, SmolLM3, Phi-3 and OLMo 2.

Each template (tests/fixtures/chat_templates/, sources in its README.md) is set on a fresh copy of
the SmolLM2 tokenizer that has the family's markers added as tokens (one id each) and the family's
bos/eos/pad. What each template renders for a reply is written out below from the template text
(`Family.trained_reply`), independently of jaxsft, and the trained tokens must decode to exactly
that plus the family's end-of-turn marker: nothing of the system and user turns, no generation
prompt.
"""

import dataclasses
import pathlib

import numpy as np
import pytest
from tokenizers import AddedToken

from jaxsft.data import IGNORE_INDEX, SpanRenderer, load_records, render_with_spans, tokenize_example, tokenize_records

TEMPLATES = pathlib.Path(__file__).parent / "fixtures" / "chat_templates"
MAX_LENGTH = 100_000  # nothing is cut


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  special: tuple[str, ...]  # added as special tokens
  plain: tuple[str, ...]  # added as ordinary tokens (Qwen3 and SmolLM3 do not mark <think> special)
  bos: str | None
  eos: str
  pad: str
  generation_prompt: str  # what add_generation_prompt appends (default reasoning mode): never trained
  end_of_turn: str  # trained after every reply

  def trained_reply(self, messages: list, i: int) -> str:
    """The trained text of assistant turn i of the whole conversation: what the template renders
    for it after the generation prompt, and the end-of-turn marker."""
    return self._reply(messages, i) + self.end_of_turn

  def _reply(self, messages: list, i: int) -> str:
    content = messages[i]["content"]
    if self.name == "gemma3":
      return content.strip()  # `message['content'] | trim`
    if self.name == "smollm3":
      # /think: the reply as written; /no_think: after `<think>\n\n</think>\n`, which the
      # generation prompt already ends with (prompt, not trained)
      return content.lstrip("\n")
    if self.name == "qwen3":
      reasoning = messages[i].get("reasoning_content")
      if reasoning is None:
        reasoning = ""
        if "</think>" in content:
          reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
          content = content.split("</think>")[-1].lstrip("\n")
      last_query = max(j for j, m in enumerate(messages) if m["role"] == "user")
      if i > last_query and (i == len(messages) - 1 or reasoning):
        return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
      return content
    return content  # phi3, olmo2: the content as it is


FAMILIES = {
    # Qwen/Qwen3-0.6B: bos null, eos <|im_end|>, pad <|endoftext|>
    "qwen3": Family("qwen3", ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), ("<think>", "</think>"), None,
                    "<|im_end|>", "<|endoftext|>", "<|im_start|>assistant\n", "<|im_end|>"),
    # google/gemma-3-1b-it: the turn ends with <end_of_turn>, which is not the tokenizer's eos
    "gemma3": Family("gemma3", ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), (), "<bos>", "<eos>",
                     "<pad>", "<start_of_turn>model\n", "<end_of_turn>"),
    # HuggingFaceTB/SmolLM3-3B
    "smollm3": Family("smollm3", ("<|im_start|>", "<|im_end|>"), ("<think>", "</think>"), None, "<|im_end|>",
                      "<|im_end|>", "<|im_start|>assistant\n", "<|im_end|>"),
    # microsoft/Phi-3-mini-4k-instruct: eos <|endoftext|> closes the conversation, <|end|> every turn
    "phi3": Family("phi3", ("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), (), "<s>",
                   "<|endoftext|>", "<|endoftext|>", "<|assistant|>\n", "<|end|>"),
    # allenai/OLMo-2-0425-1B-Instruct: bos == eos == <|endoftext|>, which also ends every reply
    "olmo2": Family("olmo2", ("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"), (),
                    "<|endoftext|>", "<|endoftext|>", "<|pad|>", "<|assistant|>\n", "<|endoftext|>"),
}

CONVERSATIONS = [  # hand-made, each with a system message
    [{"role": "system", "content": "You are a terse assistant. Answer in one line."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome."},
     {"role": "user", "content": "Which one is bigger?"},
     {"role": "assistant", "content": "Paris has more people:\n- Paris: 2.1M\n- Rome: 2.8M... no, Rome."}],
    [{"role": "system", "content": "Write Python."},
     {"role": "user", "content": "Print hello."},
     {"role": "assistant", "content": "```python\nprint('hello')\n```\n"},
     {"role": "user", "content": "  Now twice, please.  "},
     {"role": "assistant", "content": "  for _ in range(2):\n    print('hello')"}],
]


@pytest.fixture(scope="module")
def records(shared_data):
  """Real records: every multi-turn conversation of the chat demo, and single-turn ones."""
  chat = load_records(shared_data / "chat_multiturn_demo.json")
  alpaca = load_records(shared_data / "alpaca_en_demo.json")
  multi = [r for r in chat if len(r["messages"]) > 2]
  assert len(multi) >= 70
  return multi + [r for r in chat if len(r["messages"]) == 2][:30] + alpaca[:60]


@pytest.fixture(scope="module")
def family_tokenizers():
  """One fresh SmolLM2 tokenizer per family, with that family's tokens and chat template."""
  from jaxsft.models import load_tokenizer, resolve_model

  out = {}
  for name, family in FAMILIES.items():
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, special=True)
                                                          for t in family.special]})
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in family.plain])
    tok.bos_token, tok.eos_token, tok.pad_token = family.bos, family.eos, family.pad
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    for marker in family.special + family.plain:
      assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1, (name, marker)
    out[name] = tok
  return out


def trained_runs(example):
  """Contiguous runs of trained token ids (labels equal input_ids where trained)."""
  runs, current = [], []
  for token, label in zip(example["input_ids"].tolist(), example["labels"].tolist()):
    if label != IGNORE_INDEX:
      assert label == token
      current.append(token)
    elif current:
      runs.append(current)
      current = []
  return runs + ([current] if current else [])


def find_all(ids: list, sub: list) -> list[int]:
  return [k for k in range(len(ids) - len(sub) + 1) if ids[k:k + len(sub)] == sub]


def check_example(tok, family: Family, messages: list, example: dict, *, train_on: str = "all_assistant") -> None:
  """Asserts the labels of `example` (the tokenization of `messages`) train exactly the replies."""
  turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  if train_on == "last":
    turns = turns[-1:]
  text = tok.apply_chat_template(messages, tokenize=False)
  ids = example["input_ids"].tolist()
  # input_ids are the whole render: the prompt stays in the input
  assert ids == tok(text, add_special_tokens=False)["input_ids"]
  runs = trained_runs(example)
  assert len(runs) == len(turns)
  for run, i in zip(runs, turns):
    got, want = tok.decode(run), family.trained_reply(messages, i)
    # A reply that starts with whitespace can share its first token with the whitespace that ends the
    # generation prompt; that one token is trained (see the module docstring of jaxsft/data/tokenize.py).
    assert got == want or (want[:1].isspace() and got == family.generation_prompt[-1] + want), (got, want)
  # the generation prompt, once per assistant turn, is never trained (its last, whitespace,
  # character is left out of the search: it may be merged with the reply's first token)
  prompt = tok(family.generation_prompt.rstrip(), add_special_tokens=False)["input_ids"]
  at = find_all(ids, prompt)
  assert len(at) == sum(m["role"] == "assistant" for m in messages)
  assert all((example["labels"][k:k + len(prompt)] == IGNORE_INDEX).all() for k in at)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_trained_tokens_are_exactly_the_replies(family_tokenizers, records, name):
  tok, family = family_tokenizers[name], FAMILIES[name]
  for messages in [r["messages"] for r in records] + CONVERSATIONS:
    check_example(tok, family, messages, tokenize_example(tok, {"messages": messages}, max_length=MAX_LENGTH))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_system_and_user_turns_are_not_trained(family_tokenizers, name):
  tok, family = family_tokenizers[name], FAMILIES[name]
  messages = CONVERSATIONS[0]
  text, spans = render_with_spans(tok, {"messages": messages})
  example = tokenize_example(tok, {"messages": messages}, max_length=MAX_LENGTH)
  enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
  for m in messages:
    if m["role"] == "assistant":
      continue
    start = text.index(m["content"])  # Gemma folds the system message into the first user turn
    end = start + len(m["content"])
    inside = [t for t, (s, e) in enumerate(enc["offset_mapping"]) if s < end and e > start]
    assert inside and (example["labels"][inside] == IGNORE_INDEX).all(), (name, m["role"])
  assert [text[s:e] for s, e in spans] == [family.trained_reply(messages, i) for i, m in enumerate(messages)
                                           if m["role"] == "assistant"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fast_path_equals_the_reference(family_tokenizers, records, name):
  tok = family_tokenizers[name]
  hand = [{"messages": m} for m in CONVERSATIONS + [QWEN3_REASONING, QWEN3_REASONING_FIELDS, SMOLLM3_REASONING]]
  for train_on in ("all_assistant", "last"):
    renderer = SpanRenderer(tok, train_on=train_on)
    for record in records:
      assert renderer(record) == render_with_spans(tok, record, train_on=train_on)
    # One render per record, multi-turn included; Gemma's `| trim` makes contents with leading or
    # trailing whitespace non-opaque, and those records take the reference path.
    trimmed = sum(any(m["content"] != m["content"].strip() for m in r["messages"]) for r in records)
    assert renderer.fallbacks == (trimmed if name == "gemma3" else 0)
    for record in hand:
      assert renderer(record) == render_with_spans(tok, record, train_on=train_on)
    batch = records + hand
    tokenized = tokenize_records(tok, batch, max_length=MAX_LENGTH, train_on=train_on, batch_size=16)
    for record, example in zip(batch, tokenized.examples):
      single = tokenize_example(tok, record, max_length=MAX_LENGTH, train_on=train_on)
      np.testing.assert_array_equal(example["input_ids"], single["input_ids"])
      np.testing.assert_array_equal(example["labels"], single["labels"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_train_on_last_trains_only_the_last_reply(family_tokenizers, records, name):
  tok, family = family_tokenizers[name], FAMILIES[name]
  multi = [r["messages"] for r in records if len(r["messages"]) >= 6][:10] + CONVERSATIONS
  for messages in multi:
    example = tokenize_example(tok, {"messages": messages}, max_length=MAX_LENGTH, train_on="last")
    check_example(tok, family, messages, example, train_on="last")
    assert len(trained_runs(example)) == 1


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_checks_catch_wrong_labels(family_tokenizers, name):
  """The checks above fail on labels that train one prompt token more or one marker token less."""
  tok, family = family_tokenizers[name], FAMILIES[name]
  messages = CONVERSATIONS[0]
  example = tokenize_example(tok, {"messages": messages}, max_length=MAX_LENGTH)
  check_example(tok, family, messages, example)
  trained = np.flatnonzero(example["labels"] != IGNORE_INDEX)
  for k, label in ((trained[0] - 1, example["input_ids"][trained[0] - 1]), (trained[-1], IGNORE_INDEX)):
    labels = example["labels"].copy()
    labels[k] = label
    with pytest.raises(AssertionError):
      check_example(tok, family, messages, {"input_ids": example["input_ids"], "labels": labels})


# ---------------------------------------------------------------------------------------------
# Reasoning templates: the labels follow what the full render contains.

QWEN3_REASONING = [
    {"role": "system", "content": "Think step by step."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "<think>\nThe user wants a greeting.\n</think>\n\nHello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n\n4"},
]

QWEN3_REASONING_FIELDS = [  # the same reasoning as `reasoning_content`
    *QWEN3_REASONING[:2],
    {"role": "assistant", "content": "Hello!", "reasoning_content": "The user wants a greeting."},
    QWEN3_REASONING[3],
    {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."},
]

SMOLLM3_REASONING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n4"},
]


def test_qwen3_think_block_of_the_final_turn_is_trained(family_tokenizers):
  """Qwen3 renders `<think>\\n\\n</think>\\n\\n` only in the turn after the last user query. The
  generation prompt is `<|im_start|>assistant\\n`, so the model must produce that block: it is
  trained with the reply. Earlier replies render (and train) without it."""
  tok, family = family_tokenizers["qwen3"], FAMILIES["qwen3"]
  messages = CONVERSATIONS[0]
  text, spans = render_with_spans(tok, {"messages": messages})
  assert text.count("<think>") == 1
  trained = [text[s:e] for s, e in spans]
  assert trained == ["Paris.<|im_end|>", "Rome.<|im_end|>", "<think>\n\n</think>\n\n" + messages[-1]["content"] + "<|im_end|>"]
  assert trained[-1] != messages[-1]["content"] + "<|im_end|>"  # the block is not left out
  # Rendered as the last turn, the first reply gets a think block the full render does not have:
  # prefix renders cannot locate it.
  first = tok.apply_chat_template(messages[:3], tokenize=False)
  assert "<think>" in first and not text.startswith(first)
  example = tokenize_example(tok, {"messages": messages}, max_length=MAX_LENGTH)
  check_example(tok, family, messages, example)
  think = tok.convert_tokens_to_ids("<think>")
  at = int(np.flatnonzero(example["input_ids"] == think)[0])
  assert example["labels"][at] == think


def test_qwen3_reasoning_of_earlier_turns_is_dropped_and_of_the_final_turn_trained(family_tokenizers):
  tok, family = family_tokenizers["qwen3"], FAMILIES["qwen3"]
  messages = QWEN3_REASONING
  text, spans = render_with_spans(tok, {"messages": messages})
  assert "The user wants a greeting." not in text  # the template drops a historical turn's reasoning
  assert [text[s:e] for s, e in spans] == ["Hello!<|im_end|>", "<think>\nTwo plus two.\n</think>\n\n4<|im_end|>"]
  check_example(tok, family, messages, tokenize_example(tok, {"messages": messages}, max_length=MAX_LENGTH))
  # the same reasoning given as `reasoning_content` renders, and trains, the same
  fields = QWEN3_REASONING_FIELDS
  assert render_with_spans(tok, {"messages": fields}) == (text, spans)
  check_example(tok, family, fields, tokenize_example(tok, {"messages": fields}, max_length=MAX_LENGTH))
  assert SpanRenderer(tok)({"messages": fields}) == (text, spans)


def test_smollm3_think_mode_trains_the_reply_as_written(family_tokenizers):
  """/think (the default): replies render verbatim, a `<think>...</think>` in one is trained."""
  tok, family = family_tokenizers["smollm3"], FAMILIES["smollm3"]
  text, spans = render_with_spans(tok, {"messages": SMOLLM3_REASONING})
  assert "Reasoning Mode: /think" in text
  assert [text[s:e] for s, e in spans] == ["<think>\nTwo plus two.\n</think>\n4<|im_end|>"]
  example = tokenize_example(tok, {"messages": SMOLLM3_REASONING}, max_length=MAX_LENGTH)
  check_example(tok, family, SMOLLM3_REASONING, example)


def test_smollm3_no_think_block_is_prompt(family_tokenizers):
  """/no_think in the system message: the generation prompt ends with `<think>\\n\\n</think>\\n` and
  every reply renders after the same empty block, so the block is prompt, not trained."""
  tok, family = family_tokenizers["smollm3"], FAMILIES["smollm3"]
  messages = [{"role": "system", "content": "Be brief. /no_think"}] + CONVERSATIONS[0][1:]
  prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
  assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
  text, spans = render_with_spans(tok, {"messages": messages})
  assert "Reasoning Mode: /no_think" in text and "Be brief.\n\n" in text and "/no_think\n\n<|im_start|>user" not in text
  assert text.count("<think>\n\n</think>\n") == 3
  replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
  assert [text[s:e] for s, e in spans] == replies
  assert all(not text[s:e].startswith("<think>") for s, e in spans)
  example = tokenize_example(tok, {"messages": messages}, max_length=MAX_LENGTH)
  check_example(tok, family, messages, example)
  think = tok.convert_tokens_to_ids("<think>")
  assert (example["labels"][example["input_ids"] == think] == IGNORE_INDEX).all()


def test_phi3_end_of_conversation_eos_is_not_trained(family_tokenizers):
  """Phi-3 closes a conversation with `<|endoftext|>` after the last `<|end|>\\n`; the turn itself ends
  with `<|end|>` (what every earlier turn ends with), so the final eos is not trained."""
  tok, family = family_tokenizers["phi3"], FAMILIES["phi3"]
  messages = CONVERSATIONS[0]
  text, spans = render_with_spans(tok, {"messages": messages})
  assert text.endswith(messages[-1]["content"] + "<|end|>\n<|endoftext|>")
  assert text[spans[-1][0]:spans[-1][1]] == messages[-1]["content"] + "<|end|>"
  example = tokenize_example(tok, {"messages": messages}, max_length=MAX_LENGTH)
  assert example["input_ids"][-1] == tok.eos_token_id and example["labels"][-1] == IGNORE_INDEX
  end = tok.convert_tokens_to_ids("<|end|>")
  ends = np.flatnonzero(example["input_ids"] == end)
  # system and user <|end|> are prompt, the assistant ones trained: same id, different labels
  assert [int(example["labels"][k] == end) for k in ends] == [0, 0, 1, 0, 1, 0, 1]


def test_olmo2_bos_and_reply_eos_are_the_same_token(family_tokenizers):
  tok = family_tokenizers["olmo2"]
  example = tokenize_example(tok, {"messages": CONVERSATIONS[0]}, max_length=MAX_LENGTH)
  eos = tok.eos_token_id
  ends = np.flatnonzero(example["input_ids"] == eos)
  assert ends[0] == 0 and len(ends) == 4  # the template's leading bos, then one eos per reply
  assert example["labels"][0] == IGNORE_INDEX and (example["labels"][ends[1:]] == eos).all()


def test_gemma3_folds_the_system_message_into_the_first_user_turn(family_tokenizers):
  tok = family_tokenizers["gemma3"]
  messages = CONVERSATIONS[0]
  text, spans = render_with_spans(tok, {"messages": messages})
  assert text.startswith(f"<bos><start_of_turn>user\n{messages[0]['content']}\n\n{messages[1]['content']}<end_of_turn>\n")
  assert "<eos>" not in text  # turns end with <end_of_turn>, not the tokenizer's eos
  example = tokenize_example(tok, {"messages": messages}, max_length=MAX_LENGTH)
  end = tok.convert_tokens_to_ids("<end_of_turn>")
  ends = np.flatnonzero(example["input_ids"] == end)
  assert [int(example["labels"][k] == end) for k in ends] == [0, 1, 0, 1, 0, 1]
  # the trimmed reply: its leading and trailing whitespace is not in the render
  text2, spans2 = render_with_spans(tok, {"messages": CONVERSATIONS[1]})
  assert text2[spans2[-1][0]:spans2[-1][1]] == CONVERSATIONS[1][-1]["content"].strip() + "<end_of_turn>"
