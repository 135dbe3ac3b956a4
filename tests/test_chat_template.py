"""`model.chat_template`: a template file or tokenizer folder replacing the tokenizer's own chat
template, in training, and in the chat, evaluate and export of the run."""

import argparse
import json

import pytest

from jaxsft import cli, errors, export
from jaxsft.models import hub
from jaxsft.run_files import resolve_run
from test_train import base_args

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}### User:\n{{ m['content'] }}\n"
            "{% elif m['role'] == 'system' %}### System:\n{{ m['content'] }}\n"
            "{% else %}### Assistant:\n{{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}### Assistant:\n{% endif %}")


@pytest.fixture
def template_file(tmp_path):
  path = tmp_path / "sharp.jinja"
  path.write_text(TEMPLATE)
  return path


def test_a_template_is_read_from_a_file_or_a_tokenizer_folder(template_file, tmp_path):
  assert hub.read_chat_template(template_file) == TEMPLATE
  jinja_folder = tmp_path / "jinja_folder"
  jinja_folder.mkdir()
  (jinja_folder / "chat_template.jinja").write_text(TEMPLATE)
  assert hub.read_chat_template(jinja_folder) == TEMPLATE
  config_folder = tmp_path / "config_folder"
  config_folder.mkdir()
  (config_folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
  assert hub.read_chat_template(config_folder) == TEMPLATE


@pytest.mark.parametrize("name, text, words", [
    ("broken.jinja", "{% for m in messages %}{{ m['content'] }}", ["broken.jinja", "line 1"]),
    ("empty_folder", None, ["empty_folder", "no chat_template.jinja"]),
    ("missing.jinja", None, ["missing.jinja", "cannot read it"]),
])
def test_a_template_that_cannot_be_used_is_named(tmp_path, name, text, words):
  path = tmp_path / name
  if text is not None:
    path.write_text(text)
  elif name == "empty_folder":
    path.mkdir()
  with pytest.raises(errors.ModelError) as e:
    hub.read_chat_template(path)
  for word in words:
    assert word in str(e.value), (word, str(e.value))


@pytest.mark.slow
def test_a_run_trains_on_its_template_and_chat_and_export_use_it(tiny_dir, small_data, template_file, tmp_path,
                                                                   train_main):
  from transformers import AutoTokenizer

  from jaxsft.chat import load
  from jaxsft.data.template import render_with_spans

  run = tmp_path / "run"
  r = train_main(base_args(tiny_dir, small_data, run, "--chat-template", template_file, "max_steps=1",
                           "eval.generate=false"))
  assert r.returncode == 0, r.stderr
  assert json.loads((run / "config.json").read_text())["model"]["chat_template"] == str(template_file)
  source = resolve_run(run)
  assert source.chat_template == str(template_file)
  _, tokenizer = load(source.model, source.adapter, source.dtype, chat_template=source.chat_template)
  record = json.loads((run / "heldout.json").read_text())[0]
  text, spans = render_with_spans(tokenizer, record)
  assert text.startswith("### User:\n") and text[spans[-1][0]:].startswith(record["messages"][-1]["content"])
  # chat's and export's --chat-template replaces the run's; without it, the run's is used.
  parser = argparse.ArgumentParser()
  cli.add_model_source(parser)
  assert cli.model_source(parser.parse_args([str(run)])).chat_template == str(template_file)
  assert cli.model_source(parser.parse_args([str(run), "--chat-template", "other.jinja"])).chat_template == "other.jinja"
  out = export.export(source.model, source.adapter, tmp_path / "hf", chat_template=source.chat_template)
  assert AutoTokenizer.from_pretrained(str(out)).chat_template == TEMPLATE
  assert AutoTokenizer.from_pretrained(str(run / "adapter")).chat_template == TEMPLATE  # saved as TRL saves it
  # A template the trainer cannot read is one error line before anything is written.
  broken = tmp_path / "broken.jinja"
  broken.write_text("{% if %}")
  r = train_main(base_args(tiny_dir, small_data, tmp_path / "never", "--chat-template", broken, "max_steps=1"))
  assert r.returncode == 2 and "broken.jinja" in r.stderr and not (tmp_path / "never").exists()


@pytest.mark.slow
def test_a_gguf_export_carries_the_template_over_its_source_gguf_s_own(tiny_dir, template_file, tmp_path):
  from gguf import GGUFReader

  source = export.export(str(tiny_dir), None, tmp_path / "source", fmt="gguf") / "model.gguf"
  field = lambda path: GGUFReader(str(path)).fields["tokenizer.chat_template"].contents()
  assert "im_start" in field(source)  # the tokenizer's own
  out = export.export(str(source), None, tmp_path / "templated", fmt="gguf", chat_template=str(template_file))
  assert field(out / "model.gguf") == TEMPLATE
