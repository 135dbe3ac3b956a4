"""`jaxsft chat`: talk to a tuned model (or any model jaxsft loads).

    jaxsft chat runs/default                       # interactive, the run's model + adapter
    jaxsft chat --model smollm2-135m-instruct --adapter runs/default/adapter
    jaxsft chat runs/default --prompt "What is the code of river? ..."      # one reply
    jaxsft chat runs/default --input prompts.jsonl --output replies.jsonl   # batch

Interactive: a multi-turn conversation rendered with the model's chat template; the reply is
printed token by token as it is generated; `/reset` starts over, `/exit` (or end of input)
quits. Batch: every record `jaxsft.data.load_records` reads (Alpaca, messages, ShareGPT,
prompt/completion; a record may also stop before its reply) gets its reply added as `"reply"`;
a record with a reply is prompted with the conversation before it. The output is written
atomically. Greedy decoding unless `--temperature` > 0; a reply ends at the model's end-of-turn
token or after `--max-new-tokens`.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

from jaxsft import errors, quiet
from jaxsft.errors import JaxsftError

quiet.silence_library_noise()

EXIT_USAGE = errors.EXIT_USAGE


class ChatError(JaxsftError):
  """Bad input to the CLI (missing adapter, wrong base, unreadable prompts): exit 2."""


def build_parser() -> argparse.ArgumentParser:
  from jaxsft.cli import HelpFormatter, add_model_source

  parser = argparse.ArgumentParser(prog="jaxsft chat", description=__doc__.split("\n\n")[0],
                                   formatter_class=HelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
  load = add_model_source(parser)
  load.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                    help="compute dtype (default: the run's, else float32; auto: bfloat16 on a GPU/TPU, "
                    "float32 on a CPU)")
  prompts = parser.add_argument_group("what to answer (interactive without --prompt or --input)")
  prompts.add_argument("--system", help="a system prompt for the conversation")
  prompts.add_argument("--prompt", help="one user message: print the reply and exit")
  prompts.add_argument("--input", help="batch mode: a data file of prompts (JSON/JSONL, .gz)")
  prompts.add_argument("--output", help="batch mode: where to write the records with their replies (JSONL)")
  prompts.add_argument("--batch-size", type=int, default=8, help="batch mode: prompts decoded together")
  sampling = parser.add_argument_group("generation")
  sampling.add_argument("--max-new-tokens", type=int, default=256, help="a reply's length at most, in tokens")
  sampling.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
  sampling.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
  sampling.add_argument("--seed", type=int, default=0, help="sampling seed")
  return parser


def parse_args(argv=None) -> argparse.Namespace:
  from jaxsft.cli import check_model_source

  parser = build_parser()
  args = parser.parse_args(argv)
  check_model_source(parser, args)
  if args.run_dir and (args.quantize is not None or args.quant_block_size is not None or args.quantize_embeddings):
    parser.error("--quantize goes with --model; a RUN_DIR loads its base quantized as the run trained it")
  if args.quantize_embeddings and args.quantize in (None, "none"):
    parser.error("--quantize-embeddings goes with --quantize int8/nf4/int4/gguf")
  if args.quant_block_size is not None and args.quant_block_size < 1:
    parser.error("--quant-block-size must be >= 1")
  if (args.input is None) != (args.output is None):
    parser.error("batch mode needs both --input and --output")
  if args.input and args.prompt:
    parser.error("--prompt and --input are different modes; give one")
  if args.max_new_tokens < 1:
    parser.error("--max-new-tokens must be >= 1")
  return args


# ---------------------------------------------------------------------------------------------
# Which model: a run directory (`run_files.resolve_run`), or --model [--adapter].


def load(model_name: str, adapter: str | None, dtype: str, quantize: str = "none", quant_block_size: int = 32,
         quantize_embeddings: bool = False, chat_template: str | None = None):
  """(model, tokenizer) with the adapter applied (on the base quantized as the run trained it,
  the tokenizer with the run's chat template); ChatError on a missing or mismatched adapter."""
  from jaxsft import lora

  try:
    return lora.load_with_adapter(model_name, adapter, dtype=dtype, quantize=quantize,
                                  quant_block_size=quant_block_size, quantize_embeddings=quantize_embeddings,
                                  chat_template=chat_template)
  except ValueError as e:
    raise ChatError(str(e)) from None


def load_from_args(args):
  from jaxsft.cli import model_source

  source = model_source(args)
  return load(source.model, source.adapter, args.dtype or source.dtype, source.quantize, source.quant_block_size,
              source.quantize_embeddings, source.chat_template)


# ---------------------------------------------------------------------------------------------
# Batch mode.

_PLACEHOLDER = "\x00jaxsft-no-reply\x00"


def read_prompts(path: str) -> list[tuple[dict, list[dict]]]:
  """(raw record, prompt messages) per record of a data file.

  A record is read by `jaxsft.data.normalize_record`, so every format training accepts works.
  A record that stops before its reply (messages/conversations ending with a user turn, an
  instruction without output, a prompt without completion) is prompted as it is; one with a
  reply is prompted with the turns before its final reply.
  """
  from jaxsft.data import DataError, normalize_record
  from jaxsft.data.records import iter_raw

  out = []
  for where, raw in iter_raw(path):
    completed = raw
    if isinstance(raw, dict):
      for turns, role_key, assistant in (("messages", "role", "assistant"), ("conversations", "from", "gpt")):
        value = raw.get(turns)
        if isinstance(value, list) and value and isinstance(value[-1], dict) and \
            value[-1].get(role_key) not in ("assistant", "gpt"):
          content_key = "content" if turns == "messages" else "value"
          completed = {**raw, turns: [*value, {role_key: assistant, content_key: _PLACEHOLDER}]}
      if "instruction" in raw and "output" not in raw:
        completed = {**raw, "output": _PLACEHOLDER}
      if "prompt" in raw and "completion" not in raw:
        completed = {**raw, "completion": _PLACEHOLDER}
    try:
      messages = normalize_record(completed)["messages"]
    except DataError as e:
      raise DataError(e.reason, path=path, where=where, field=e.field) from None
    out.append((raw, messages[:-1]))
  if not out:
    raise DataError("no records (empty file or empty array)", path=path)
  return out


def run_batch(model, tokenizer, args, sampling) -> int:
  from jaxsft import io
  from jaxsft.generate import generate

  items = read_prompts(args.input)
  prompts = [_with_system(messages, args.system) for _, messages in items]
  replies = generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                     sampling=sampling, seed=args.seed)

  def write(f):
    for (raw, _), reply in zip(items, replies):
      record = dict(raw) if isinstance(raw, dict) else {"record": raw}
      record["reply"] = reply
      f.write(json.dumps(record, ensure_ascii=False) + "\n")

  io.atomic_write(args.output, write)
  print(f"wrote {len(replies)} replies to {args.output}", file=sys.stderr)
  return 0


# ---------------------------------------------------------------------------------------------
# Interactive and one-shot.


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
  if system is None or (messages and messages[0]["role"] == "system"):
    return list(messages)
  return [{"role": "system", "content": system}, *messages]


def reply(model, tokenizer, messages, args, sampling, out=None) -> str:
  """Streams the reply to `out` (sys.stdout as it is at the call) as it is generated; returns its text."""
  from jaxsft.generate import stream

  out = sys.stdout if out is None else out
  pieces = []
  for piece in stream(model, tokenizer, messages, max_new_tokens=args.max_new_tokens, sampling=sampling,
                      seed=args.seed + len(messages)):
    pieces.append(piece)
    out.write(piece)
    out.flush()
  out.write("\n")
  out.flush()
  return "".join(pieces)


def interactive(model, tokenizer, args, sampling, stdin=None, out=None) -> int:
  from jaxsft.generate import PromptTooLong

  stdin, out = sys.stdin if stdin is None else stdin, sys.stdout if out is None else out
  tty = stdin.isatty()
  if tty:
    print("jaxsft chat: type a message; /reset starts over, /exit quits.", file=sys.stderr)
  history: list[dict] = _with_system([], args.system)
  while True:
    if tty:
      out.write("\n> ")
      out.flush()
    line = stdin.readline()
    if not line:
      return 0
    text = line.rstrip("\n")
    if text.strip() == "/exit":
      return 0
    if text.strip() == "/reset":
      history = _with_system([], args.system)
      print("(conversation reset)", file=sys.stderr)
      continue
    if not text.strip():
      continue
    turn = [*history, {"role": "user", "content": text}]
    try:
      answer = reply(model, tokenizer, turn, args, sampling, out)
    except PromptTooLong as e:
      print(f"error: {e}", file=sys.stderr)
      continue
    history = [*turn, {"role": "assistant", "content": answer}]


def main(argv=None) -> int:
  logging.basicConfig(level=logging.WARNING)
  args = parse_args(argv)
  return errors.run_cli(lambda: _main(args))


def _main(args) -> int:
  from jaxsft.generate import Sampling

  try:
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
  except ValueError as e:
    raise ChatError(str(e)) from None
  if args.input and not pathlib.Path(args.input).is_file():
    raise ChatError(f"{args.input}: no such file")
  model, tokenizer = load_from_args(args)
  if args.input:
    return run_batch(model, tokenizer, args, sampling)
  if args.prompt is not None:
    reply(model, tokenizer, _with_system([{"role": "user", "content": args.prompt}], args.system), args, sampling)
    return 0
  return interactive(model, tokenizer, args, sampling)


if __name__ == "__main__":
  sys.exit(main())
