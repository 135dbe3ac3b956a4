"""Two JAX processes on one machine (2 CPU devices each, gloo collectives) train like one process.

Each process is the plain CLI started with JAX_COORDINATOR_ADDRESS (127.0.0.1 and a free port),
JAX_NUM_PROCESSES=2 and JAX_PROCESS_ID; `jaxsft.sharding.maybe_initialize_distributed` calls
`jax.distributed.initialize` with them. Each process reads its own rows of every global batch
(Grain's ShardByJaxProcess). The run is 3 steps, then a resume to 5 steps from the orbax
checkpoint both processes wrote; the same two-part run in one process on one device is the reference.
A constant learning rate keeps the schedule independent of max_steps, so the resumed steps are
the steps an uninterrupted run would take.

Compiles are counted from XLA's compile events, which a persistent-cache hit skips. The test's own
cache starts empty, so every compile of the first runs reaches XLA and is counted; the resumed runs
find the same executables there and compile only what they did not run before (a step that
recompiled would be a new shape: a miss, and counted).
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

import worker_threads
from test_train import read_metrics, run_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMON = ["--lr", "2e-3", "data.bucket_lengths=[128]", "data.max_length=128", "data.batch_size=8",
          "data.tokens_per_batch=null", "data.time_shapes=false", "--no-progress",
          "optim.schedule=constant", "optim.warmup_steps=0", "eval.eval_every=0", "save_every=0"]
PER_STEP = ("loss", "grad_norm", "lr", "tokens", "real_tokens", "valid_tokens")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_two_processes(args, timeout=400) -> list[str]:
  """The CLI in 2 processes x 2 CPU devices; returns each process's output."""
  port = _free_port()
  procs = []
  for pid in range(2):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=worker_threads.xla_flags("--xla_force_host_platform_device_count=2"),
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
    procs.append(subprocess.Popen([sys.executable, "-m", "jaxsft.train", *map(str, args)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  try:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for pid, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {pid} exited {p.returncode}:\n{out[-5000:]}"
  return outputs


def _adapter(run):
  return load_file(str(pathlib.Path(run) / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow  # four trainer processes and two runs
def test_two_processes_train_resume_and_match_one_process(tiny_dir, small_data, tmp_path, monkeypatch):
  # This test's own compilation cache, empty at the start (see the module's docstring).
  monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "true")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "xla-cache"))
  model_dir, data_path = tiny_dir, small_data  # the session's tiny Llama and 160 task records
  args = lambda out, *extra: ["--model", model_dir, "--data", data_path, "--output-dir", out, *COMMON, *extra]
  one, two = tmp_path / "one", tmp_path / "two"
  adapters, first_summaries = {}, {}
  for steps, extra, generate in ((3, [], "false"), (5, ["--resume"], "true")):
    r = run_cli(args(one, f"max_steps={steps}", "eval.generate=false", *extra))
    assert r.returncode == 0, r.stderr[-5000:]
    outputs = run_two_processes(args(two, f"max_steps={steps}", f"eval.generate={generate}", "eval.num_prompts=4",
                                     "eval.max_new_tokens=4", *extra))
    # Both processes trained; process 0 alone finished the run (plot, doctor, summary).
    assert all(f"step {steps} loss" in out for out in outputs)
    assert "jaxsft run finished" in outputs[0] and "jaxsft run finished" not in outputs[1]
    adapters[steps] = {"one": _adapter(one), "two": _adapter(two)}
    if steps == 3:
      # Every compile of the first runs reached XLA (the cache was empty).
      first_summaries = {name: json.loads((run / "summary.json").read_text()) for name, run in (("one", one), ("two", two))}
      # Each process saved its own data position into the shared orbax checkpoint.
      saved = sorted(p.name for p in (two / "checkpoints" / "3" / "data_iter").iterdir() if p.suffix == ".json")
      assert saved == ["process_0-of-2.json", "process_1-of-2.json"]
      states = [json.loads((two / "checkpoints" / "3" / "data_iter" / n).read_text()) for n in saved]
      # Every process runs the same global batch stream and keeps its rows: the same position.
      assert states[0] == states[1] and states[0]["anchor"]
    else:
      assert "resumed from step 3" in outputs[0] and "resumed from step 3" in outputs[1]

  # Per-step metrics: the losses and the global token counts of one process on one device.
  (one_train, one_val, _), (two_train, two_val, two_lines) = read_metrics(one), read_metrics(two)
  assert [l["step"] for l in two_train] == [1, 2, 3, 4, 5]  # process 0 alone wrote each line once
  assert sum(1 for l in two_lines if l.get("event") == "config") == 1
  for a, b in zip(one_train, two_train):
    for key in PER_STEP:
      assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
  assert [l["step"] for l in two_val] == [3, 5]
  np.testing.assert_allclose([l["val_loss"] for l in two_val], [l["val_loss"] for l in one_val], rtol=1e-5)
  assert two_train[-1]["loss"] != pytest.approx(two_train[0]["loss"], abs=1e-4)

  # Adapter tensors after 3 steps and after the resumed 5.
  for steps, pair in adapters.items():
    assert pair["one"].keys() == pair["two"].keys() and pair["one"]
    for key, value in pair["one"].items():
      np.testing.assert_allclose(pair["two"][key], value, atol=1e-5, rtol=0, err_msg=f"step {steps} {key}")
  moved = max(float(np.abs(adapters[5]["two"][k] - adapters[3]["two"][k]).max()) for k in adapters[3]["two"])
  assert moved > 1e-4

  # The sharded step compiled once per shape at warm-up, as many executables as one process, and
  # never after; process 0 finished the run (summary, and generation on the gathered weights).
  first, ref = first_summaries["two"], first_summaries["one"]
  assert first["recompiles"] == 0 and first["warmup_compiles"] == ref["warmup_compiles"] > 0
  assert json.loads((two / "summary.json").read_text())["recompiles"] == 0
  assert all(l["compiles"] == 0 for l in two_train)
  evaluation = json.loads((two / "evaluation.json").read_text())
  assert evaluation["tuned"]["n"] == 4 and len(evaluation["tuned"]["generations"]) == 4
