"""Shared fixtures. Every cost is paid once per session: the real tokenizer and data, the real
SmolLM2-135M-Instruct on the jaxsft side (the torch side is in torch_parity/conftest.py), a tiny
random model folder, a small synthetic data file, and XLA compiles (a persistent cache); one compute
thread per test process when the processes fill the cores (worker_threads.py)."""

import contextlib
import dataclasses
import io
import logging
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network at test time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import worker_threads  # tests/worker_threads.py
import xla_cache  # tests/xla_cache.py

worker_threads.configure()  # before anything imports JAX or torch
xla_cache.configure()  # before anything imports JAX
# Token stores and converted models of the session's runs, its subprocesses' included: a fresh
# folder, so no test depends on (or fills) the user's ~/.cache/jaxsft.
xla_cache.session_folder("JAXSFT_CACHE", "jaxsft-cache-")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
  if not SHARED_DATA.is_dir():
    pytest.fail(f"{SHARED_DATA} is missing: the shared instruction data lives beside the project root")
  return SHARED_DATA


@pytest.fixture(scope="session")
def tokenizer():
  """The real SmolLM2-135M-Instruct tokenizer (pad == eos == 2, ChatML template)."""
  from jaxsft.models.hub import load_tokenizer

  return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_jax():
  """The real SmolLM2-135M-Instruct in float32, loaded once. Shared: a test that changes it
  (LoRA, loading an adapter) works on `nnx.clone(smollm2_jax)`."""
  from jaxsft.models import load_causal_lm

  return load_causal_lm("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer):
  """A tiny random Llama as a Hugging Face folder (tests/tiny_model.py), written once."""
  from tiny_model import make_tiny_model_dir

  return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", tokenizer)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
  """160 synthetic task records as JSONL, written once."""
  from jaxsft.data import synthetic

  return synthetic.write_jsonl(synthetic.make_dataset(160, seed=1), tmp_path_factory.mktemp("data") / "tasks.jsonl")


@pytest.fixture
def no_compile_cache():
  """This test's compiles all reach XLA (and emit their compile events): the persistent cache
  is off while it runs. JAX decides once per process whether the cache is in use, so the decision
  is reset on the way in and out. Yields `restore()`, which turns the cache back on for the rest
  of the test: for runs whose compiles the test does not count."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  before = jax.config.jax_enable_compilation_cache

  def use_cache(enabled: bool) -> None:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()

  use_cache(False)
  try:
    yield lambda: use_cache(before)
  finally:
    use_cache(before)


@dataclasses.dataclass
class CliResult:
  returncode: int
  stdout: str
  stderr: str


@pytest.fixture
def run_cli(monkeypatch):
  """`run_cli(main, argv, stdin=None)`: a CLI's `main(argv)` called in this process, as
  `python -m` would run it, with its exit code (SystemExit included: argparse's errors) and what
  it wrote to stdout and stderr. Saves a subprocess's interpreter start, imports and model load
  where the subprocess itself proves nothing."""

  def run(main, argv, *, stdin: str | None = None) -> CliResult:
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin or ""))
    # The trainer's log handler writes to the sys.stderr of its first call: give each call its own.
    jaxsft_logger = logging.getLogger("jaxsft")
    saved = jaxsft_logger.handlers[:], jaxsft_logger.level, jaxsft_logger.propagate
    jaxsft_logger.handlers = []
    # The CLIs set environment variables for their process (quiet.py); later tests must not see them.
    environ = dict(os.environ)
    try:
      with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
          code = main([str(a) for a in argv])
        except SystemExit as e:
          code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
          if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    finally:
      jaxsft_logger.handlers, jaxsft_logger.level, jaxsft_logger.propagate = saved
      os.environ.clear()
      os.environ.update(environ)
    return CliResult(code, out.getvalue(), err.getvalue())

  return run


@pytest.fixture
def train_main(run_cli):
  """`train_main(argv)`: `jaxsft.train.main(argv)` in this process (see `run_cli`)."""
  from jaxsft import train

  return lambda argv: run_cli(train.main, argv)
