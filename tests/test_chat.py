"""`python -m jaxsft.chat` through a pipe: a two-turn conversation with /reset, one-shot and
batch mode equal `generate` on the same conversations; bad inputs exit 2 writing nothing.

The pipe and the one-shot prompt run as a user runs them (a subprocess with torch hidden, whose
whole stderr is checked); the other cases call `chat.main` in-process."""

import json
import os
import pathlib
import subprocess

import pytest

from jaxsft.generate import generate
from tuned_tiny import make_adapter, make_model_dir, make_run_dir, tuned_model, without_torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
  root = tmp_path_factory.mktemp("chat")
  model_dir = make_model_dir(root / "base", tokenizer)
  adapter = make_adapter(model_dir, root / "adapter")
  run = make_run_dir(root / "run", model_dir, adapter)
  model, tok = tuned_model(model_dir, adapter)
  return {"root": root, "model_dir": model_dir, "adapter": adapter, "run": run, "model": model, "tok": tok}


def chat(*args, stdin=""):
  """`python -m jaxsft.chat ARGS` with torch hidden, as in a runtime-only install."""
  env = dict(os.environ, HF_HUB_OFFLINE="1")
  for key in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY"):  # set by jaxsft imported here
    env.pop(key, None)
  return subprocess.run([*without_torch("jaxsft.chat"), *map(str, args)], cwd=ROOT, env=env, input=stdin,
                        capture_output=True, text=True, timeout=600)


def chat_main(run_cli, *args, stdin=""):
  """`chat.main(ARGS)` in this process."""
  from jaxsft import chat as chat_lib

  return run_cli(chat_lib.main, args, stdin=stdin)


def reply_to(tiny, messages):
  return generate(tiny["model"], tiny["tok"], [messages], max_new_tokens=NEW)[0]


@pytest.mark.slow
def test_two_turn_conversation_through_a_pipe(tiny):
  r = chat(tiny["run"], "--max-new-tokens", NEW, stdin="Hello there\nAnd then?\n/reset\nHello there\n/exit\nnot read\n")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "PyTorch was not found" not in r.stderr and "Warning" not in r.stderr  # a quiet start
  first = reply_to(tiny, [{"role": "user", "content": "Hello there"}])
  second = reply_to(tiny, [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
                           {"role": "user", "content": "And then?"}])
  alone = reply_to(tiny, [{"role": "user", "content": "And then?"}])
  assert first and second and second != alone  # the second turn saw the first
  assert r.stdout == f"{first}\n{second}\n{first}\n"  # streamed replies, then /reset forgot the history


@pytest.mark.slow
def test_one_shot_prompt_with_a_system_prompt(tiny):
  r = chat("--model", tiny["model_dir"], "--adapter", tiny["adapter"], "--max-new-tokens", NEW,
           "--system", "Be brief.", "--prompt", "What is 2 + 2?")
  assert r.returncode == 0, r.stderr[-2000:]
  want = reply_to(tiny, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}])
  assert r.stdout == want + "\n"
  assert r.stderr == ""  # nothing but the reply


def test_batch_mode_adds_one_reply_per_record(tiny, tmp_path, run_cli):
  records = [{"messages": [{"role": "user", "content": "Name a color."}]},
             {"instruction": "Add 2 and 3.", "output": "5", "id": 7},
             {"prompt": "Say hi"},
             {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                {"from": "human", "value": "Bye"}]}]
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  r = chat_main(run_cli, tiny["run"], "--input", path, "--output", tmp_path / "replies.jsonl", "--max-new-tokens", NEW)
  assert r.returncode == 0, r.stderr[-2000:]
  out = [json.loads(line) for line in (tmp_path / "replies.jsonl").read_text().splitlines()]
  assert len(out) == len(records)
  assert [{k: v for k, v in o.items() if k != "reply"} for o in out] == records
  prompts = [[{"role": "user", "content": "Name a color."}], [{"role": "user", "content": "Add 2 and 3."}],
             [{"role": "user", "content": "Say hi"}],
             [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "Bye"}]]
  assert [o["reply"] for o in out] == generate(tiny["model"], tiny["tok"], prompts, max_new_tokens=NEW)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "replies.jsonl"]


def test_sampling_is_seeded(tiny, run_cli):
  args = ("--model", tiny["model_dir"], "--max-new-tokens", NEW, "--temperature", "1.5", "--top-k", "50",
          "--top-p", "0.95", "--prompt", "Tell me something")
  a, b, c = (chat_main(run_cli, *args, "--seed", seed) for seed in (1, 1, 2))
  assert a.returncode == 0, a.stderr[-2000:]
  assert a.stdout == b.stdout and a.stdout != c.stdout


def test_quantize_loads_the_base_as_a_qlora_run_trained_the_adapter(tiny, run_cli):
  """--model --adapter --quantize nf4 replies as the adapter on the nf4 base does (not the float
  base's reply), --quantize-embeddings loads that base with nf4 embeddings too, and a RUN_DIR,
  which brings its own quantization, refuses the flags."""
  from jaxsft import chat, quant
  from jaxsft import lora

  messages = [{"role": "user", "content": "Hello there"}]
  model, tok = lora.load_with_adapter(str(tiny["model_dir"]), str(tiny["adapter"]), dtype="float32", quantize="nf4",
                                      quant_block_size=32)
  want = generate(model, tok, [messages], max_new_tokens=NEW)[0]
  r = chat_main(run_cli, "--model", tiny["model_dir"], "--adapter", tiny["adapter"], "--quantize", "nf4",
                "--quant-block-size", 32, "--max-new-tokens", NEW, "--prompt", "Hello there")
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout == want + "\n"
  float_reply = reply_to(tiny, messages)
  assert want != float_reply  # nf4 rounding moves this tiny random model's reply: the flag reached the load
  for flags, tables in (([], False), (["--quantize-embeddings"], True)):
    args = chat.parse_args(["--model", str(tiny["model_dir"]), "--adapter", str(tiny["adapter"]), "--quantize", "nf4",
                            *flags, "--prompt", "hi"])
    model, _ = chat.load_from_args(args)
    assert quant.is_quantized(model) and quant.model.embeddings_quantized(model) == tables
  refused = chat_main(run_cli, tiny["run"], "--quantize", "nf4", "--prompt", "hi")
  assert refused.returncode == 2 and "--quantize goes with --model" in refused.stderr
  refused = chat_main(run_cli, "--model", tiny["model_dir"], "--quantize-embeddings", "--prompt", "hi")
  assert refused.returncode == 2 and "--quantize-embeddings goes with --quantize" in refused.stderr


def test_bad_inputs_exit_2_with_a_clear_line(tiny, tmp_path, tokenizer, run_cli):
  import dataclasses

  from tuned_tiny import TINY_CHAT

  other = make_model_dir(tmp_path / "other", tokenizer, config=dataclasses.replace(TINY_CHAT, hidden_size=32, head_dim=8))
  no_adapter = tmp_path / "run-no-adapter"
  no_adapter.mkdir()
  (no_adapter / "config.json").write_text((tiny["run"] / "config.json").read_text())
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
  long_prompt = "word " * 400  # the tiny model's window is 256 tokens
  cases = {
      "no adapter": ([no_adapter, "--prompt", "hi"], "has no adapter"),
      "wrong base": (["--model", other, "--adapter", tiny["adapter"], "--prompt", "hi"], "does not fit model"),
      "bad record": ([tiny["run"], "--input", bad, "--output", tmp_path / "out.jsonl"], "line 2"),
      "too long": ([tiny["run"], "--prompt", long_prompt], "context window is 256 tokens"),
  }
  for name, (args, message) in cases.items():
    r = chat_main(run_cli, *args, "--max-new-tokens", 4)
    assert r.returncode == 2, (name, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last, (name, last)
  assert not (tmp_path / "out.jsonl").exists()


def test_a_full_fine_tuning_run_is_chatted_with_through_its_model_folder(tiny, tmp_path):
  import shutil

  from jaxsft.chat import load
  from jaxsft.run_files import resolve_run

  run = tmp_path / "full-run"
  run.mkdir()
  shutil.copy(tiny["run"] / "config.json", run / "config.json")
  shutil.copytree(tiny["model_dir"], run / "model")
  source = resolve_run(str(run))
  assert source.model == str(run / "model") and source.adapter is None
  model, tok = load(source.model, source.adapter, "float32")
  messages = [{"role": "user", "content": "Hello there"}]
  base = generate(model, tok, [messages], max_new_tokens=NEW)
  assert base != [reply_to(tiny, messages)]  # the run's own weights, not base + adapter
