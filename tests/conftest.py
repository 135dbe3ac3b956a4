"""Shared fixtures. The real tokenizer and data are loaded once per session."""

import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network at test time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent XLA cache for the session's training subprocesses: runs with the same model and
# shapes (resume tests, repeated CLI runs) compile once. Results are unchanged; compile events
# are still counted.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile

  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxsft-xla-cache-")

import pytest

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
