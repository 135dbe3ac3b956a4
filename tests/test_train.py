"""The trainer end to end on a tiny random Llama (real tokenizer, real pipeline).

The end-to-end run is what a user runs: `jaxsft.train.main` in a fresh interpreter with torch
hidden from the import system (the runtime must not need it); so is the killed run and its resume
(test_tracking.py, which also reads the event files they write). The other runs check files and
metrics the same code path writes, so they call `main` in-process.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hide_torch import PRELUDE
from xla_cache import NO_COMPILE_CACHE_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs `jaxsft.train.main(argv)` in a fresh interpreter where torch cannot be found or imported.
_HIDE_TORCH = PRELUDE + textwrap.dedent("""
    from jaxsft.train import main
    code = main(sys.argv[1:])
    assert "torch" not in sys.modules, "the runtime imported torch"
    sys.exit(code)
""")


def run_cli(args, *, wait=True, env_extra=None, **kw):
  env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
  cmd = [sys.executable, "-c", _HIDE_TORCH, *map(str, args)]
  if not wait:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kw)


def base_args(tiny_dir, small_data, out, *extra):
  return ["--model", tiny_dir, "--data", small_data, "--output-dir", out, "--lr", "2e-3", "data.num_buckets=2",
          "data.batch_size=8", "data.tokens_per_batch=none", "data.max_val_examples=16",
          # No timing calls at warm-up where a test does not read the fitted cost (the end-to-end test does).
          "data.time_shapes=false",
          # A constant rate, so a test's steps are comparable whatever its run length (the schedule is a
          # step input: every length shares the session's compiles). The end-to-end test keeps the default
          # warm-up and cosine decay.
          "optim.schedule=constant", "optim.warmup_steps=0", "--no-progress", *extra]


def read_metrics(run):
  lines = [json.loads(l) for l in (pathlib.Path(run) / "metrics.jsonl").read_text().splitlines()]
  return [l for l in lines if "loss" in l], [l for l in lines if "val_loss" in l], lines


@pytest.mark.slow
def test_cli_end_to_end_on_a_tiny_model(tiny_dir, small_data, tmp_path, train_main):
  out = tmp_path / "run"
  # Its compiles are counted: none may come from the session's persistent cache.
  settings = ["max_steps=8", "eval.eval_every=4", "save_every=4", "eval.num_prompts=4", "eval.max_new_tokens=4",
              "data.time_shapes=true", "optim.schedule=cosine", "optim.warmup_steps=null"]
  r = run_cli(base_args(tiny_dir, small_data, out, *settings), env_extra=NO_COMPILE_CACHE_ENV)
  assert r.returncode == 0, r.stdout + r.stderr
  train, val, lines = read_metrics(out)
  assert [l["step"] for l in train] == list(range(1, 9))
  assert [l["step"] for l in val] == [0, 4, 8]  # step 0: the base model's held-out loss
  config = lines[0]
  assert config["event"] == "config" and config["warmup_compiles"] >= len(config["batch_shapes"])
  # the doctor's uniform level, ln(vocab_size), needs the model's vocabulary
  assert config["vocab_size"] == json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
  for l in train:
    assert l["compiles"] == 0  # every shape compiled at warm-up
    assert np.isfinite(l["loss"]) and l["valid_tokens"] > 0 and 0 <= l["padding_fraction"] < 1
    for key in ("lr", "grad_norm", "tokens", "tokens_per_s", "data_wait_s", "seconds"):
      assert key in l
  # The bucket widths are the config's shapes and nothing else.
  assert {tuple(s) for s in config["batch_shapes"]} >= {(8, w) for w in config["bucket_lengths"]}
  for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "loss_curve.png",
               "summary.json", "doctor.txt", "evaluation.json", "config.json", "heldout.json"):
    assert (out / name).is_file(), name
  # The base's own chat template: the adapter is its two files (test_chat_template: another template).
  assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 8 and summary["recompiles"] == 0
  collation = summary["collation"]  # every mode records its predicted and measured seconds
  assert collation["choice"] == "bucketed K=2" and collation["batching"]["bucket_lengths"] == config["bucket_lengths"]
  assert all(collation[k]["steps"] > 0 and collation[k]["compiles"] > 0 for k in ("predicted_seconds", "measured_seconds"))
  assert collation["cost"]["source"].startswith("measured: ")  # fitted to this run's timed shapes
  assert "task_score_base" in summary and "task_score_tuned" in summary
  assert summary["matmul_path"].startswith("float32 products on XLA's CPU kernels")  # which kernels ran, said
  assert f"matmuls: {summary['matmul_path']}" in r.stdout
  adapter_config = json.loads((out / "adapter/adapter_config.json").read_text())
  assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 16  # the embedded default (jaxsft/configs/default.yaml)
  assert "loss curve:" in r.stdout and "task score" in r.stdout  # the closing summary is on stdout
  # A second run into the same folder without --resume is refused, and nothing is touched.
  before = (out / "metrics.jsonl").read_text()
  again = train_main(base_args(tiny_dir, small_data, out, "max_steps=8"))
  assert again.returncode == 2 and "--resume" in again.stderr
  assert (out / "metrics.jsonl").read_text() == before
  # --resume with the same settings (a job script that always passes it): nothing is left to train,
  # so nothing loads, compiles or is written again, and the run's closing summary is shown as it was.
  files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
  again = train_main(base_args(tiny_dir, small_data, f"{out}/.", *settings, "--resume"))  # the folder spelled otherwise
  assert again.returncode == 0, again.stderr
  assert "finished at step 8 (completed); nothing left to train" in again.stderr
  assert "loading model" not in again.stderr and "warm-up" not in again.stderr
  assert again.stdout == r.stdout[r.stdout.index("\n== jaxsft run finished"):]
  assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == files
  # A higher max_steps goes on training.
  again = train_main(base_args(tiny_dir, small_data, out, *settings[1:], "max_steps=9", "--resume"))
  assert again.returncode == 0 and "resumed from step 8" in again.stderr, again.stderr
  assert json.loads((out / "summary.json").read_text())["steps"] == 9


DETERMINISTIC = ("loss", "grad_norm", "lr", "tokens", "real_tokens", "valid_tokens", "epoch")
"""Per-step metrics that a resumed run reproduces exactly (timings are not among them)."""


@pytest.mark.slow
def test_bad_config_and_bad_data_write_nothing(tiny_dir, small_data, tmp_path, train_main):
  out = tmp_path / "never"
  r = train_main(base_args(tiny_dir, small_data, out, "optim.learning_rate=1"))
  assert r.returncode == 2 and "unknown key 'optim.learning_rate'" in r.stderr and "optim.lr" in r.stderr
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": 7}\n')
  r = train_main(base_args(tiny_dir, bad, out))
  assert r.returncode == 2
  assert "bad.jsonl" in r.stderr and "line 2" in r.stderr and "output" in r.stderr
  r = train_main(base_args(tiny_dir, small_data, out, "mesh.data=3"))
  assert r.returncode == 2 and "mesh" in r.stderr
  # Truncation that leaves no reply token: no batch to train on, or a validation loss over 0 tokens.
  r = train_main(base_args(tiny_dir, small_data, out, "--max-length", "4"))
  assert r.returncode == 2 and "tasks.jsonl: the training records: all 144 are cut at max_length 4" in r.stderr
  long_prompt = tmp_path / "long_prompt.jsonl"
  long_prompt.write_text(json.dumps({"instruction": " ".join(["word"] * 200), "output": "ok"}) + "\n")
  r = train_main(base_args(tiny_dir, small_data, out, "--max-length", "64", "--val-data", long_prompt))
  assert r.returncode == 2, r.stderr
  assert "long_prompt.jsonl: the held-out records: all 1 are cut at max_length 64" in r.stderr
  assert "none has a token to score" in r.stderr and "raise --max-length" in r.stderr
  assert not out.exists()


@pytest.mark.slow
def test_non_finite_steps_stop_the_run_and_keep_what_was_saved(tiny_dir, small_data, tmp_path, tokenizer, train_main):
  from tiny_model import make_tiny_model_dir

  out = tmp_path / "nan"
  common = ["save_every=3", "eval.eval_every=0", "eval.generate=false"]
  r = train_main(base_args(tiny_dir, small_data, out, "max_steps=3", *common))
  assert r.returncode == 0, r.stderr
  adapter = (out / "adapter" / "adapter_model.safetensors").read_bytes()
  # Same run continued on corrupt weights (NaN in one projection): every loss is NaN from now on.
  nan_dir = make_tiny_model_dir(tmp_path / "nan_model", tokenizer, nan_weights=True)
  r = train_main(base_args(nan_dir, small_data, out, "max_steps=20", "--resume", *common))
  assert r.returncode == 2, r.stderr
  assert "3 consecutive steps with a non-finite loss or gradient" in r.stderr
  train, _, _ = read_metrics(out)
  assert [l["step"] for l in train if l.get("skipped")] == [4, 5, 6]
  # The last good checkpoint and adapter are what step 3 saved.
  assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == adapter
  assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]


@pytest.mark.slow
def test_accumulated_micro_batches_equal_one_batch_whatever_the_padding(tokenizer):
  """Two micro-batches padded to different buckets == one batch (Σ nll / Σ valid, same grads)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxsft import config as config_lib
  from jaxsft import data, lora, models
  from jaxsft import step as step_lib
  from jaxsft.data import synthetic
  from tiny_model import TINY

  jax.config.update("jax_default_matmul_precision", "highest")
  cfg = config_lib.TrainConfig()
  model = models.init_random(TINY, seed=0)
  # A sharper (tied) output embedding: a near-uniform random model gives every batch the same
  # mean loss, which would hide a mean of means.
  model.embed_tokens[...] = model.embed_tokens[...] * 30.0
  lora.apply_lora(model, r=4, alpha=8, seed=1)
  graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
  # Non-zero B so the gradient reaches A too.
  params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(2), x.shape), params)
  schedule = step_lib.make_schedule(cfg.optim, 10)
  tx = step_lib.make_optimizer(cfg.optim, schedule)
  # Jitted, as the trainer runs them (op by op, the tiny model's step takes longer than its compiles).
  zeros, accumulate, apply, evaluate = (jax.jit(f) for f in step_lib.make_step_functions(graphdef, cfg))
  examples = [data.tokenize_example(tokenizer, r, max_length=1024) for r in synthetic.make_dataset(40, seed=5)]
  examples = [e for e in examples if len(e["input_ids"]) <= 120][:8]
  one = data.collate(examples, pad_token_id=2, bucket_lengths=[256])
  # Uneven micro-batches (1 and 7 examples): a mean of means would weight them 50/50.
  first = data.collate(examples[:1], pad_token_id=0, pad_to_multiple_of=8, batch_size=2)  # another pad id, a fill row
  second = data.collate(examples[1:], pad_token_id=2, bucket_lengths=[128, 256])
  acc_one = accumulate(zeros(params), params, frozen, one, 0)
  acc_two = accumulate(accumulate(zeros(params), params, frozen, first, 0), params, frozen, second, 1)
  assert int(acc_one["n_valid"]) == int(acc_two["n_valid"]) == sum(int((e["labels"] != -100).sum()) for e in examples)
  np.testing.assert_allclose(acc_one["nll"], acc_two["nll"], rtol=1e-6)
  for g1, g2 in zip(jax.tree.leaves(acc_one["grads"]), jax.tree.leaves(acc_two["grads"])):
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-6)
  # apply normalizes once: the gradient it clips and reports is Σ∇nll / Σ valid, the same from
  # either accumulator.
  _, _, out_one = apply(params, jax.jit(tx.init)(params), acc_one, schedule)
  _, _, out = apply(params, jax.jit(tx.init)(params), acc_two, schedule)
  summed_norm = float(np.sqrt(sum(float(jnp.sum(g * g)) for g in jax.tree.leaves(acc_one["grads"]))))
  assert summed_norm > 0
  np.testing.assert_allclose(out["grad_norm"], summed_norm / int(acc_one["n_valid"]), rtol=1e-5)
  np.testing.assert_allclose(out["grad_norm"], out_one["grad_norm"], rtol=1e-5)
  assert float(out["loss"]) == pytest.approx(float(out_one["loss"]), rel=1e-6)
  # The step's loss is the global Σ nll / Σ valid, not the mean of the two micro-batch means.
  nll1, n1 = evaluate(params, frozen, first)
  nll2, n2 = evaluate(params, frozen, second)
  mean_of_means = float(nll1 / n1 + nll2 / n2) / 2
  assert abs(mean_of_means - float(nll1 + nll2) / float(n1 + n2)) > 1e-4 * mean_of_means  # the test can tell
  assert float(out["loss"]) == pytest.approx(float(nll1 + nll2) / float(n1 + n2), rel=1e-6)


@pytest.mark.slow
def test_a_shape_outside_the_warm_up_set_is_counted_as_a_recompile(no_compile_cache):
  import jax
  from flax import nnx

  from jaxsft import config as config_lib
  from jaxsft import lora, models, sharding
  from jaxsft import step as step_lib
  from tiny_model import TINY

  cfg = config_lib.TrainConfig()
  model = models.init_random(TINY, seed=0)
  lora.apply_lora(model, r=2, alpha=4)
  graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
  schedule = step_lib.make_schedule(cfg.optim, 10)
  tx = step_lib.make_optimizer(cfg.optim, schedule)
  ctx = sharding.make_mesh_context(cfg.mesh)
  steps = step_lib.CompiledSteps(step_lib.make_step_functions(graphdef, cfg), params,
                                 jax.jit(tx.init)(params), frozen, ctx, schedule)
  keys = ("input_ids", "attention_mask", "labels")
  steps.warm_up([(2, 16)], keys, with_eval=False)
  batch = lambda t: ctx.put_batch({"input_ids": np.ones((2, t), np.int32), "attention_mask": np.ones((2, t), np.int32),
                                   "labels": np.ones((2, t), np.int32)})
  acc = steps.accumulate(steps.zeros(params), params, frozen, batch(16), np.int32(0))
  assert steps.recompiles == 0 and not steps.unexpected_shapes
  steps.accumulate(acc, params, frozen, batch(24), np.int32(1))
  assert steps.recompiles >= 1 and steps.unexpected_shapes == [("accumulate", (2, 24))]


def _damage(checkpoint):
  """Overwrites the bytes of every file of a checkpoint's arrays (sizes kept)."""
  files = [p for p in (checkpoint / "state").rglob("*") if p.is_file()]
  assert files
  for p in files:
    p.write_bytes(b"\xff" * max(p.stat().st_size, 1))


@pytest.mark.slow
def test_resume_falls_back_past_a_damaged_checkpoint(tiny_dir, small_data, tmp_path, train_main):
  steps = ["save_every=2", "keep_checkpoints=3", "eval.eval_every=0", "eval.generate=false"]
  out = tmp_path / "run"
  r = train_main(base_args(tiny_dir, small_data, out, "max_steps=5", *steps))
  assert r.returncode == 0, r.stderr
  ckpt = out / "checkpoints"
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [2, 4, 5]
  _damage(ckpt / "5")
  r = train_main(base_args(tiny_dir, small_data, out, "max_steps=7", "--resume", *steps))
  assert r.returncode == 0, r.stderr
  assert f"checkpoint {ckpt / '5'} is damaged" in r.stderr and "resumed from step 4" in r.stderr
  assert (out / "damaged_checkpoints" / "5").is_dir()
  train, _, _ = read_metrics(out)
  assert [l["step"] for l in train] == list(range(1, 8))
  # Every checkpoint damaged: one clear line, exit 2.
  for p in ckpt.iterdir():
    if p.name.isdigit():
      _damage(p)
  r = train_main(base_args(tiny_dir, small_data, out, "max_steps=9", "--resume", *steps))
  assert r.returncode == 2
  assert "restores whole" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_resumed_run_keeps_the_collation_it_started_with(tiny_dir, small_data, tmp_path, train_main):
  """bucketed_packed chooses its widths from the lengths, pricing compiles over the planned steps: a
  resume with another max_steps (or, under auto, other timings) could choose other batches, which the
  checkpoint's data position does not belong to. The resumed run keeps the first one's and trains on
  the batches an uninterrupted run with that collation trains on; a config that fixes another
  collation is refused."""
  steps = ["save_every=3", "eval.eval_every=0", "eval.generate=false", "data.batching=bucketed_packed"]
  out = tmp_path / "run"
  r = train_main(base_args(tiny_dir, small_data, out, "max_steps=3", *steps))
  assert r.returncode == 0, r.stderr
  first = json.loads((out / "summary.json").read_text())["collation"]["batching"]
  assert [l for l in read_metrics(out)[2] if l.get("event") == "config"][0]["collation"] == first
  r = train_main(base_args(tiny_dir, small_data, out, "max_steps=6", "--resume", *steps))
  assert r.returncode == 0, r.stderr
  assert "as this run chose at its start" in r.stderr and "resumed from step 3" in r.stderr
  assert json.loads((out / "summary.json").read_text())["collation"]["batching"] == first
  fixed = [f"data.bucket_lengths={json.dumps(first['bucket_lengths'])}", f"data.max_length={first['max_length']}"]
  r = train_main(base_args(tiny_dir, small_data, tmp_path / "straight", "max_steps=6", *steps, *fixed))
  assert r.returncode == 0, r.stderr
  resumed, straight = read_metrics(out)[0], read_metrics(tmp_path / "straight")[0]
  assert [l["step"] for l in resumed] == list(range(1, 7))
  for a, b in zip(resumed, straight):
    assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}, a["step"]
  r = train_main(base_args(tiny_dir, small_data, out, "max_steps=9", "--resume", *steps, "data.batching=static"))
  assert r.returncode == 2 and "Traceback" not in r.stderr
  assert "--resume: the checkpoints' data position belongs to the batches of bucketed_packed" in r.stderr


@pytest.mark.slow
def test_data_running_out_early_still_ends_with_a_fresh_validation(tiny_dir, small_data, tmp_path, tokenizer, train_main):
  """Packed epochs can pack tighter than the first one (the planned step count is one epoch's
  batches x epochs): the run then stops early, and its last validation is of its last step."""
  from jaxsft import config_args
  from jaxsft import data
  from jaxsft.train.data_plan import load_data

  packed = ["data.batching=packed", "data.max_length=256", "data.batch_size=4", "epochs=2"]
  cfg = config_args.parse_args([str(a) for a in base_args(tiny_dir, small_data, tmp_path / "unused", *packed)])
  kw = dict(max_length=256, batching="packed", batch_size=4, tokens_per_batch=None)
  for seed in range(20):  # a data order whose second epoch packs into fewer batches
    cfg.data.seed = seed
    records, _ = load_data(cfg)
    tokens = data.tokenize_records(tokenizer, records, max_length=256)
    planned = 2 * data.count_batches(tokens, seed=seed, **kw)
    if sum(1 for _ in data.make_batches(records, tokenizer, seed=seed, num_epochs=2, tokenized=tokens, **kw)) < planned:
      break
  else:
    pytest.skip("no seed in 0..19 packs its second epoch tighter")
  out = tmp_path / "run"
  r = train_main(base_args(tiny_dir, small_data, out, *packed, f"data.seed={seed}", "eval.eval_every=5",
                           "eval.generate=false"))
  assert r.returncode == 0, r.stderr
  assert "the data ran out" in r.stderr
  train, val, _ = read_metrics(out)
  last_step = train[-1]["step"]
  assert last_step < planned and val[-1]["step"] == last_step
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == last_step and summary["val_loss"] == val[-1]["val_loss"]


@pytest.mark.slow
def test_epoch_loss_and_valid_tokens_use_the_loss_count(small_data, tmp_path, tokenizer, train_main):
  """Replies that start a row: the loss cannot score a row's first token (nothing predicts it),
  so the logged valid tokens and the epoch average count labels[1:], as the loss does."""
  import copy

  from jaxsft import data
  from tiny_model import make_tiny_model_dir

  content_only = copy.deepcopy(tokenizer)
  content_only.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  model_dir = make_tiny_model_dir(tmp_path / "model", content_only)
  words = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel"]
  records = [{"messages": [{"role": "assistant", "content": " ".join(words[i % 8:] + words[:i % 5])}]} for i in range(40)]
  path = tmp_path / "replies.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  out = tmp_path / "run"
  r = train_main(base_args(model_dir, path, out, "data.val_fraction=0", "eval.generate=false", "eval.eval_every=0"))
  assert r.returncode == 0, r.stderr
  train, _, lines = read_metrics(out)
  examples = data.tokenize_records(content_only, records, max_length=1024).examples
  assert all(e["labels"][0] != -100 for e in examples)  # every row starts with a trained token
  assert sum(l["valid_tokens"] for l in train) == sum(len(e["labels"]) - 1 for e in examples)
  (epoch,) = [l for l in lines if "epoch_loss" in l]
  weighted = sum(l["loss"] * l["valid_tokens"] for l in train) / sum(l["valid_tokens"] for l in train)
  assert epoch["epoch_loss"] == pytest.approx(weighted, rel=1e-5)


@pytest.mark.slow
def test_max_steps_repeats_the_data_and_dynamic_compiles_the_data_shapes(tiny_dir, tmp_path, train_main,
                                                                         no_compile_cache):
  """max_steps beyond one epoch runs that many steps (the data repeats); dynamic batching compiles
  the widths of the batches the run reads, over both epochs, and no other: not every multiple of 8
  up to max_length, nor every width the stored lengths give."""
  from jaxsft.data import TokenStore, round_up, synthetic

  # 40 records of four lengths (three widths), against 64 multiples of 8 up to 512. Each
  # width is a cold compile (the cache is off to count them), so few widths keep the test short.
  four = synthetic.make_dataset(4, seed=5)
  path = tmp_path / "four_lengths.jsonl"
  path.write_text("".join(json.dumps(four[i % 4]) + "\n" for i in range(40)))
  cache = tmp_path / "tokens"
  out = tmp_path / "run"
  # Every record trains (no held-out split, so no evaluation executables): the compiles are the
  # training step's, one per width.
  r = train_main(base_args(tiny_dir, path, out, "max_steps=7", "data.batching=dynamic", "eval.eval_every=0",
                           "eval.generate=false", "data.val_fraction=0", f"data.cache_dir={cache}"))
  assert r.returncode == 0, r.stderr[-3000:]
  train, _, lines = read_metrics(out)
  config = lines[0]
  assert config["steps_per_epoch"] == 5 and config["total_steps"] == 7  # 40 training records / 8
  assert [l["step"] for l in train] == list(range(1, 8))
  assert [l["epoch"] for l in train] == [0] * 5 + [1] * 2
  (folder,) = list(cache.iterdir())  # the file's one token store
  every_width = {(8, min(round_up(int(n), 8), 512)) for n in TokenStore(folder).tokenized().lengths}
  read = sorted({(8, l["tokens"] // 8) for l in train})  # the widths of the 7 batches the steps took
  assert [tuple(s) for s in config["batch_shapes"]] == read
  assert set(read) < every_width and len(every_width) == 3  # not all: 7 batches of 8 rarely miss the longest
  assert config["warmup_compiles"] == len(read)  # one fused step per width, nothing else
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 7 and summary["recompiles"] == 0  # no batch of either epoch needed another
  assert summary["collation"]["cost"]["source"].startswith("default: ")  # data.time_shapes=false: no timing calls
  # The store's key is the data and the tokenization, not the batching: a bucketed run finds it.
  # Its compiles are not counted: the session's cache may serve them (no_compile_cache yields its restore).
  no_compile_cache()
  again = train_main(base_args(tiny_dir, path, tmp_path / "run2", "max_steps=1", "data.batching=bucketed",
                               "eval.generate=false", f"data.cache_dir={cache}"))
  assert again.returncode == 0, again.stderr[-3000:]
  assert "token store" in again.stderr and "found in" in again.stderr  # the second run tokenizes nothing
  # A fixed number of buckets is chosen from lengths alone: time_shapes=false times nothing there either.
  bucketed = json.loads((tmp_path / "run2" / "summary.json").read_text())["collation"]
  assert bucketed["choice"] == "bucketed K=2" and bucketed["cost"]["source"].startswith("default: "), bucketed
