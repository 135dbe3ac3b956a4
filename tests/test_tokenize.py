"""tokenize_example / tokenize_records: labels from the reply spans of the rendered chat template
(real tokenizer), and the TokenizedRecords they return."""

import copy

import numpy as np
import pytest

from jaxsft.data import (IGNORE_INDEX, DataError, SkipReport, load_records, render_with_spans, tokenize_example,
                         tokenize_file, tokenize_records)

IM_END = "<|im_end|>"


def trained_runs(example):
  """Contiguous runs of trained token ids."""
  runs, current = [], []
  for token, label in zip(example["input_ids"], example["labels"]):
    if label != IGNORE_INDEX:
      assert label == token  # labels are aligned with input_ids
      current.append(int(token))
    elif current:
      runs.append(current)
      current = []
  return runs + ([current] if current else [])


@pytest.fixture(scope="module")
def chat(shared_data):
  return load_records(shared_data / "chat_multiturn_demo.json")


def test_multiturn_trained_spans_are_exactly_the_replies(tokenizer, chat):
  multi = 0
  for record in chat:
    example = tokenize_example(tokenizer, record, max_length=100_000)
    replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    multi += len(replies) > 1
    runs = trained_runs(example)
    assert len(runs) == len(replies)
    for run, reply in zip(runs, replies):
      decoded = tokenizer.decode(run)
      # A reply starting with whitespace shares its first token with the "\n" after "assistant".
      assert decoded.endswith(reply + IM_END)
      assert decoded[: -len(reply + IM_END)] in ("", "\n")
  assert multi >= 70  # the file has 77 multi-turn conversations


def test_prompt_and_system_tokens_are_never_trained(tokenizer, chat):
  record = {"messages": [{"role": "system", "content": "Be brief."}] + chat[0]["messages"]}
  example = tokenize_example(tokenizer, record, max_length=100_000)
  text, spans = render_with_spans(tokenizer, record)
  assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
  enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
  for (start, end), label in zip(enc["offset_mapping"], example["labels"]):
    inside = any(start < e and end > s for s, e in spans)
    assert (label != IGNORE_INDEX) == inside
  # the generation prompt "<|im_start|>assistant\n" is not trained
  header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
  ids = example["input_ids"].tolist()
  at = next(i for i in range(len(ids)) if ids[i:i + len(header)] == header)
  assert (example["labels"][at:at + len(header)] == IGNORE_INDEX).all()
  assert example["labels"][at + len(header)] != IGNORE_INDEX


def test_train_on_last(tokenizer, chat):
  record = next(r for r in chat if len(r["messages"]) >= 6)
  example = tokenize_example(tokenizer, record, max_length=100_000, train_on="last")
  runs = trained_runs(example)
  assert len(runs) == 1 and tokenizer.decode(runs[0]).endswith(record["messages"][-1]["content"] + IM_END)


@pytest.mark.parametrize("train_on", ["all_assistant", "last"])
def test_a_reply_of_weight_0_stays_in_the_prompt_untrained(tokenizer, chat, tmp_path, train_on):
  """OpenAI's per-turn weight: 0 keeps a reply out of the loss; the text is unchanged."""
  import json

  from jaxsft.data.template import SpanRenderer

  record = next(r for r in chat if sum(m["role"] == "assistant" for m in r["messages"]) >= 3)
  replies = [i for i, m in enumerate(record["messages"]) if m["role"] == "assistant"]
  weighted = copy.deepcopy(dict(record))
  weighted["messages"][replies[0]]["weight"] = 0
  weighted["messages"][replies[-1]]["weight"] = 0  # "last": the final reply that is trained
  for i in replies[1:-1]:
    weighted["messages"][i]["weight"] = 1
  path = tmp_path / "weighted.jsonl"
  path.write_text(json.dumps(weighted) + "\n")
  (loaded,) = load_records(path)
  assert [m.get("weight") for m in loaded["messages"]] == [0 if i in (replies[0], replies[-1]) else None
                                                           for i in range(len(loaded["messages"]))]
  text, spans = render_with_spans(tokenizer, loaded, train_on=train_on)
  assert SpanRenderer(tokenizer, train_on=train_on)(loaded) == (text, spans)
  assert text == render_with_spans(tokenizer, record)[0]  # the weight changes no token
  trained = replies[1:-1][-1:] if train_on == "last" else replies[1:-1]
  runs = trained_runs(tokenize_example(tokenizer, loaded, max_length=100_000, train_on=train_on))
  assert [tokenizer.decode(run).strip() for run in runs] == [record["messages"][i]["content"].strip() + IM_END
                                                              for i in trained]


@pytest.mark.parametrize("turns, words", [
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}],
     ["messages[1].weight", "every assistant turn has weight 0"]),
    ([{"role": "user", "content": "a", "weight": 1}, {"role": "assistant", "content": "b"}],
     ["messages[0].weight", "only an assistant turn"]),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0.5}],
     ["messages[1].weight", "must be 0 or 1, got 0.5"]),
])
def test_a_bad_weight_is_named(tmp_path, turns, words):
  import json

  path = tmp_path / "w.jsonl"
  path.write_text(json.dumps({"messages": turns}) + "\n")
  with pytest.raises(DataError) as e:
    load_records(path)
  for word in words:
    assert word in str(e.value), (word, str(e.value))


def test_reply_starting_with_newline_merges_across_the_seam(tokenizer):
  record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n\nHello"}]}
  example = tokenize_example(tokenizer, record, max_length=64)
  text, [(start, _)] = render_with_spans(tokenizer, record)
  enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
  seam = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < start < e]
  assert len(seam) == 1  # one token covers "\n" of the header and the reply's first "\n"
  assert example["labels"][seam[0]] == example["input_ids"][seam[0]]
  assert tokenizer.decode(trained_runs(example)[0]) == "\n\n\nHello" + IM_END
  # A token-prefix check would have failed here: the prompt's tokens are not a prefix of the full tokens.
  prompt = tokenizer.apply_chat_template(record["messages"][:1], tokenize=False, add_generation_prompt=True)
  prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
  assert example["input_ids"][: len(prompt_ids)].tolist() != prompt_ids


def test_no_double_bos_and_pad_eos_not_used_for_masking(tokenizer, chat):
  example = tokenize_example(tokenizer, chat[0], max_length=100_000)
  assert example["input_ids"][0] == tokenizer.bos_token_id and example["input_ids"][1] != tokenizer.bos_token_id
  im_end = tokenizer.convert_tokens_to_ids(IM_END)
  ends = np.flatnonzero(example["input_ids"] == im_end)
  # system and user <|im_end|> are not trained, the reply's is: same id, different labels
  assert example["labels"][ends[0]] == IGNORE_INDEX and example["labels"][ends[-1]] == im_end


def test_truncation_keeps_start_and_drops_untrained(tokenizer, chat):
  full = tokenize_example(tokenizer, chat[0], max_length=100_000)
  n_prompt = int(np.argmax(full["labels"] != IGNORE_INDEX))
  cut = tokenize_example(tokenizer, chat[0], max_length=n_prompt + 3)
  np.testing.assert_array_equal(cut["input_ids"], full["input_ids"][: n_prompt + 3])
  np.testing.assert_array_equal(cut["labels"], full["labels"][: n_prompt + 3])
  assert tokenize_example(tokenizer, chat[0], max_length=n_prompt) is None


def test_plain_template_without_chat_template(tokenizer):
  plain = copy.deepcopy(tokenizer)
  plain.chat_template = None
  record = {"messages": [{"role": "system", "content": "S."}, {"role": "user", "content": "Q?"},
                         {"role": "assistant", "content": "A."}]}
  text, spans = render_with_spans(plain, record)
  assert text == "S.\n\nUser: Q?\n\nAssistant: A.<|im_end|>\n\n"
  assert [text[s:e] for s, e in spans] == ["A.<|im_end|>"]
  example = tokenize_example(plain, record, max_length=64)
  assert tokenizer.decode(trained_runs(example)[0]) == " A.<|im_end|>"  # " A" overlaps the reply


def test_batched_equals_single(tokenizer, chat):
  sample = chat[:40]
  tokenized = tokenize_records(tokenizer, sample, max_length=512)
  assert len(tokenized) == 40 and tokenized.max_length == 512 and tokenized.train_on == "all_assistant"
  for record, example, n in zip(sample, tokenized.examples, tokenized.full_lengths):
    single = tokenize_example(tokenizer, record, max_length=512)
    if single is None:
      assert example is None
      continue
    np.testing.assert_array_equal(example["input_ids"], single["input_ids"])
    np.testing.assert_array_equal(example["labels"], single["labels"])
    assert min(n, 512) == len(single["input_ids"])  # n: the length before truncation
  kept = [len(e["input_ids"]) for e in tokenized.examples if e is not None]
  assert tokenized.lengths.tolist() == kept


def test_with_max_length_equals_tokenizing_at_it(tokenizer, chat):
  sample = chat[:60]
  long = tokenize_records(tokenizer, sample, max_length=512)
  for max_length in (40, 200):
    short, direct = long.with_max_length(max_length), tokenize_records(tokenizer, sample, max_length=max_length)
    assert short.max_length == max_length and (short.full_lengths == direct.full_lengths).all()
    assert [e is None for e in short.examples] == [e is None for e in direct.examples]
    for a, b in zip(short.examples, direct.examples):
      if a is not None:
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
  assert any(e is None for e in long.with_max_length(40).examples)  # re-cutting drops like tokenizing does
  assert (long.full_lengths > 512).any()
  with pytest.raises(ValueError, match="cannot extend"):
    long.with_max_length(4096)  # what was cut at 512 is gone


# ---------------------------------------------------------------------------------------------
# The fast path (`SpanRenderer`, char_to_token labels) equals the prefix-render reference.

EDGE_RECORDS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n\nHello"}]},
    {"messages": [{"role": "user", "content": "emoji?"}, {"role": "assistant", "content": "🙂 你好 ok"}]},
    {"messages": [{"role": "user", "content": "ends"}, {"role": "assistant", "content": "trailing 你好🙂"}]},
    {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""},
                  {"role": "assistant", "content": "reply to nothing"}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "a"}, {"role": "assistant", "content": "  a  "}]},
    {"messages": [{"role": "user", "content": "<|im_end|> inside"}, {"role": "assistant", "content": "<|im_start|>x"}]},
]


@pytest.mark.slow
def test_fast_path_equals_prefix_renders(tokenizer, chat, shared_data):
  from jaxsft.data import SpanRenderer

  records = chat + load_records(shared_data / "oasst_top_paths.jsonl") + EDGE_RECORDS
  for train_on in ("all_assistant", "last"):
    renderer = SpanRenderer(tokenizer, train_on=train_on)
    for record in records:
      assert renderer(record) == render_with_spans(tokenizer, record, train_on=train_on)
    assert renderer.fallbacks == 0  # ChatML treats contents as opaque: every record took the fast path
    tokenized = tokenize_records(tokenizer, records, max_length=4096, train_on=train_on, batch_size=7)
    for record, example in zip(records, tokenized.examples):
      single = tokenize_example(tokenizer, record, max_length=4096, train_on=train_on)
      np.testing.assert_array_equal(example["input_ids"], single["input_ids"])
      np.testing.assert_array_equal(example["labels"], single["labels"])


def test_content_dependent_template_falls_back_exactly(tokenizer, chat):
  """A template that trims contents is not opaque: its records take the prefix-render path and
  still get the reference spans."""
  from jaxsft.data import SpanRenderer

  trimming = copy.deepcopy(tokenizer)
  trimming.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | trim")
  records = chat[:20] + [{"messages": [{"role": "user", "content": " q "}, {"role": "assistant", "content": " a \n"}]}]
  renderer = SpanRenderer(trimming)
  for record in records:
    assert renderer(record) == render_with_spans(trimming, record)
  assert renderer.fallbacks >= 1  # the padded record's render differs from its sentinel skeleton
  tokenized = tokenize_records(trimming, records, max_length=4096)
  for record, example in zip(records, tokenized.examples):
    single = tokenize_example(trimming, record, max_length=4096)
    np.testing.assert_array_equal(example["labels"], single["labels"])


def test_labels_without_offsets_equal_the_offsets_rule(tokenizer):
  """char_to_token runs equal the overlap rule, including multi-byte characters split over
  several byte tokens at a span's edges."""
  from jaxsft.data.tokenize import _contiguous_offsets, _labels_from_offsets, _trained_runs

  backend = tokenizer.backend_tokenizer
  assert _contiguous_offsets(backend)  # SmolLM2: byte-level BPE, no normalizer, no offset trimming
  text = "<|im_start|>assistant\n你好🙂 world  \n\n🙂<|im_end|>\n"
  enc = backend.encode(text, add_special_tokens=False)
  ids = np.asarray(enc.ids, np.int32)
  for s in range(len(text)):
    for e in range(s + 1, len(text) + 1):
      runs = _trained_runs(enc, [(s, e)], len(ids))
      fast = np.full(len(ids), IGNORE_INDEX, np.int32)
      for a, b in runs:
        fast[a:b] = ids[a:b]
      np.testing.assert_array_equal(fast, _labels_from_offsets(ids, np.asarray(enc.offsets).reshape(-1, 2), [(s, e)]))


# ChatML, plus a note after any turn that contains "zzz": the text after a reply depends on the
# reply, so its span cannot be located.
NOTE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% if 'zzz' in m['content'] %}(note)\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that refuses some conversations with raise_exception, as Gemma's and Mistral's do.
REFUSING_TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'refuse' %}"
                     "{{ raise_exception('no refusals here') }}{% endif %}"
                     "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(tokenizer, template):
  copied = copy.deepcopy(tokenizer)
  copied.chat_template = template
  return copied


@pytest.fixture
def unlabelable(tmp_path):
  """JSONL whose record on line 5 (after a blank line and an invalid one) the note template cannot label."""
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a"\n{"prompt": "a", "completion": "c"}\n'
                  '{"prompt": "q", "completion": "zzz"}\n{"prompt": "d", "completion": "e"}\n')
  return path


def test_a_record_the_template_cannot_label_is_named_by_file_and_line(tokenizer, unlabelable):
  tok = with_template(tokenizer, NOTE_TEMPLATE)
  records = load_records(unlabelable, on_error="skip")
  with pytest.raises(DataError) as info:
    tokenize_records(tok, records, max_length=64)
  assert str(info.value).startswith(f"{unlabelable}: line 5: assistant turn 1: the chat template renders the rest "
                                    "of the conversation differently depending on the reply's text")
  plain = [dict(r) for r in records]  # records that do not know where they were read: their index
  with pytest.raises(DataError, match=r"^record 2: assistant turn 1: "):
    tokenize_records(tok, plain, max_length=64)


def test_tokenize_file_raises_or_skips_what_the_template_cannot_label(tokenizer, unlabelable, caplog):
  tok = with_template(tokenizer, NOTE_TEMPLATE)
  with pytest.raises(DataError, match=r"d.jsonl: line 3: invalid JSON"):
    tokenize_file(tok, unlabelable, max_length=64)
  unlabelable.write_text(unlabelable.read_text().replace('{"prompt": "a"\n', '\n'))
  with pytest.raises(DataError, match=r"d.jsonl: line 5: assistant turn 1: .*cannot locate the reply span$"):
    tokenize_file(tok, unlabelable, max_length=64)
  report = SkipReport()
  with caplog.at_level("WARNING", logger="jaxsft.data"):
    records, tokenized = tokenize_file(tok, unlabelable, max_length=64, on_error="skip", report=report)
  assert "skipped 1 of 4 records" in caplog.text and "cannot locate the reply span" in caplog.text
  assert report.total == 4 and [where for where, _ in report.skipped] == ["line 5"]
  assert report.skipped[0][1].startswith("assistant turn 1: the chat template renders the rest")
  assert [r["messages"][1]["content"] for r in records] == ["b", "c", "e"] and len(tokenized) == 3
  reference = tokenize_records(tok, records, max_length=64)
  for a, b in zip(tokenized.examples, reference.examples):
    np.testing.assert_array_equal(a["labels"], b["labels"])


def test_a_conversation_the_template_refuses_is_a_bad_record(tokenizer, tmp_path):
  tok = with_template(tokenizer, REFUSING_TEMPLATE)
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "refuse", "completion": "c"}\n')
  with pytest.raises(DataError, match=r"d.jsonl: line 2: the chat template rejects the conversation: no refusals here"):
    tokenize_file(tok, path, max_length=64)
  with pytest.raises(DataError, match=r"d.jsonl: line 2: the chat template rejects"):
    tokenize_records(tok, load_records(path), max_length=64)  # the fast path's direct render refuses it too
  report = SkipReport()
  records, _ = tokenize_file(tok, path, max_length=64, on_error="skip", report=report)
  assert len(records) == 1 and [where for where, _ in report.skipped] == ["line 2"]
  assert report.skipped[0][1].startswith("the chat template rejects the conversation: no refusals here (the template of ")
