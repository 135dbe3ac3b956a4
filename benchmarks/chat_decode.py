"""Streaming a chat reply token by token on a CPU: milliseconds per token, the 16-bit layer stacks
packed once before decoding (as `jaxsft.generate` does) against packed in every token's call.

    python -m benchmarks.chat_decode [--model smollm2-135m-instruct] [--dtypes bfloat16 float32]
        [--tokens 64] [--reps 2] [--suffix _NAME]

Each cell is a fresh process: it streams one reply of 4 tokens (compiling the prefill and the
one-token step), then times `jaxsft.generate.stream` producing `--tokens` tokens three times and
keeps the fastest (prefill included, which is one call against `--tokens`). Cells run interleaved,
`--reps` times; the table gives the median over repetitions. "packed in every call" replaces
`generate.with_layers_packed` by the identity, so each token's jitted call packs the stacks
itself (what `stack16` costs without the ahead-of-time packing). float32 has nothing to pack: its
row is the reference the 16-bit rows compare with.

Writes benchmarks/results/chat_decode{suffix}.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import common

PROMPT = [{"role": "user", "content": "Write a long story about a cat who learns to sail."}]


def worker(model_name: str, dtype: str, packing: str, tokens: int) -> dict:
  from jaxsft import generate

  if packing == "every call":
    generate.with_layers_packed = lambda state: state
  model = common.load_jax_model(model_name, dtype=dtype)
  tokenizer = common.load_tokenizer()
  for _ in generate.stream(model, tokenizer, PROMPT, max_new_tokens=4):
    pass
  times = []
  for _ in range(3):
    t0 = time.perf_counter()
    count = sum(1 for _ in generate.stream(model, tokenizer, PROMPT, max_new_tokens=tokens))
    times.append(time.perf_counter() - t0)
  from jaxsft import host_memory

  return {"seconds": min(times), "pieces": count, "ms_per_token": 1e3 * min(times) / tokens,
          "host_malloc": host_memory.setting()}


def cells(dtypes) -> list[tuple[str, str]]:
  out = []
  for dtype in dtypes:
    out += [(dtype, "once")] + ([(dtype, "every call")] if dtype != "float32" else [])
  return out


def run(args) -> list[dict]:
  from jaxsft import host_memory

  rows = {cell: [] for cell in cells(args.dtypes)}
  env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(common.ROOT))
  env = host_memory.environment_with_huge_pages(env) or env  # as the `jaxsft chat` command line starts
  for rep in range(args.reps):
    for dtype, packing in rows:
      cmd = [sys.executable, "-c", "import json, sys; from benchmarks.chat_decode import worker; "
             "print(json.dumps(worker(*sys.argv[1:4], int(sys.argv[4]))))",
             args.model, dtype, packing, str(args.tokens)]
      load = os.getloadavg()[0]
      r = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True, check=True)
      result = json.loads(r.stdout.strip().splitlines()[-1])
      rows[(dtype, packing)].append({**result, "load_at_start": round(load, 2)})
      print(json.dumps({"rep": rep, "dtype": dtype, "packing": packing, **rows[(dtype, packing)][-1]}), flush=True)
  return [{"dtype": d, "packing": p, "runs": runs,
           "ms_per_token": statistics.median(r["ms_per_token"] for r in runs)} for (d, p), runs in rows.items()]


def markdown(result: dict) -> str:
  lines = ["# Streaming a chat reply on a CPU: ms per token", "",
           f"Machine: {common.machine_line(result['machine'])}", "",
           f"Model {result['model']}, {result['tokens']} tokens a reply (prefill included), fastest of 3 in each "
           f"fresh process, median over {result['reps']} interleaved repetitions. Command: `{result['command']}`", "",
           "| dtype | layer stacks packed | ms per token | each repetition |", "| --- | --- | ---: | --- |"]
  for row in result["rows"]:
    packing = "n/a (float32)" if row["dtype"] == "float32" else row["packing"]
    lines.append(f"| {row['dtype']} | {packing} | {row['ms_per_token']:.1f} | "
                 f"{', '.join(format(r['ms_per_token'], '.1f') for r in row['runs'])} |")
  return "\n".join(lines + [""])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="smollm2-135m-instruct")
  parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--suffix", default="")
  args = parser.parse_args(argv)
  result = {"machine": common.machine_info(), "model": args.model, "tokens": args.tokens, "reps": args.reps,
            "command": " ".join(["python -m benchmarks.chat_decode", *(argv or sys.argv[1:])])}
  result["rows"] = run(args)
  common.write_results(f"chat_decode{args.suffix}", result, markdown(result))
  print(markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
