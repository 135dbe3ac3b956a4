"""Every reader of a file a user points at, fed random and mutated bytes of a small valid file of
its format (hypothesis): the file reads, or the command's error path (`errors.run_cli`) prints one
`error:` line naming the file and exits 2. Never another exception (a traceback), never a large
allocation from a header's claim, never a file written. What the fuzzing found is kept as
`@example`s."""

import contextlib
import gzip
import io
import json
import pathlib
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxsft import errors

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@st.composite
def mutations(draw, valid: bytes):
  """Bytes near `valid`: random bytes, a cut, flipped bytes, bytes inserted, or a range repeated."""
  kind = draw(st.sampled_from(["random", "cut", "flip", "insert", "repeat"]))
  if kind == "random":
    return draw(st.binary(max_size=512))
  at = draw(st.integers(0, len(valid)))
  if kind == "cut":
    return valid[:at]
  if kind == "insert":
    return valid[:at] + draw(st.binary(min_size=1, max_size=16)) + valid[at:]
  if kind == "repeat":
    return valid[:at] + valid[at:at + draw(st.integers(1, 64))] * draw(st.integers(2, 50)) + valid[at:]
  data = bytearray(valid)
  for position, value in draw(st.lists(st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)), min_size=1,
                                       max_size=8)):
    data[position] = value
  return bytes(data)


def listing(folder: pathlib.Path) -> dict[str, int]:
  return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))}


def read_as_the_cli_does(read, path: pathlib.Path, named: str | None = None) -> None:
  """`read(path)` under the commands' error handling: it succeeds, or it is one `error:` line
  naming the file (`named`: the name the line must hold, the file's own by default); a bug's
  exception propagates, and hypothesis reports the bytes. Nothing appears beside the file, and
  the reader allocates no more than a few times the file's size."""
  before = listing(path.parent)
  err = io.StringIO()
  tracemalloc.start()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      code = errors.run_cli(lambda: (read(path), None)[1])
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  lines = [line for line in err.getvalue().splitlines() if line.strip()]
  assert code in (0, errors.EXIT_USAGE), (code, lines)
  if code:
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, lines
    assert (named or path.name) in lines[-1], lines[-1]
  assert listing(path.parent) == before
  assert peak < 64 * 2**20 + 50 * path.stat().st_size, peak


def written(folder: pathlib.Path, name: str, data: bytes) -> pathlib.Path:
  path = folder / name
  path.write_bytes(data)
  return path


# ---------------------------------------------------------------------------------------------
# Data files: JSON arrays, JSONL (plain and gzipped), parquet.

RECORDS = [{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
           {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]
JSON_ARRAY = json.dumps(RECORDS, indent=1).encode()
JSONL = b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS)
GZIPPED_JSONL = gzip.compress(JSONL, mtime=0)


def load_records(path):
  from jaxsft.data import records

  return records.load_records(path)


@FUZZ
@given(data=mutations(JSON_ARRAY))
def test_json_array_data(tmp_path_factory, data):
  read_as_the_cli_does(load_records, written(tmp_path_factory.mktemp("fuzz"), "data.json", data))


@FUZZ
@given(data=mutations(JSONL))
def test_jsonl_data(tmp_path_factory, data):
  read_as_the_cli_does(load_records, written(tmp_path_factory.mktemp("fuzz"), "data.jsonl", data))


@FUZZ
@given(data=mutations(GZIPPED_JSONL))
@example(data=GZIPPED_JSONL[:10] + b"\0" + GZIPPED_JSONL[11:])  # zlib.error from the deflate stream
def test_gzipped_jsonl_data(tmp_path_factory, data):
  read_as_the_cli_does(load_records, written(tmp_path_factory.mktemp("fuzz"), "data.jsonl.gz", data))


def parquet_bytes() -> bytes:
  import pyarrow as pa
  import pyarrow.parquet as pq

  sink = io.BytesIO()
  pq.write_table(pa.table({"instruction": ["Add 2 and 3.", "Name a colour."], "output": ["5", "Red"]}), sink)
  return sink.getvalue()


@FUZZ
@given(data=mutations(parquet_bytes()))
@example(data=b"\0" + parquet_bytes())  # pyarrow's message on two lines
def test_parquet_data(tmp_path_factory, data):
  read_as_the_cli_does(load_records, written(tmp_path_factory.mktemp("fuzz"), "data.parquet", data))


# ---------------------------------------------------------------------------------------------
# Configs: the training YAML, a model's config.json, a PEFT adapter_config.json.

YAML = b"""model:
  name: smollm2-135m-instruct
optim:
  lr: 2.0e-4
  grad_accum: 2
lora:
  r: 8
  target_modules: [q_proj, v_proj]
max_steps: 10
"""


@FUZZ
@given(data=mutations(YAML))
@example(data=b"\x80")  # not UTF-8
@example(data=b"\0")  # PyYAML's message on two lines
@example(data=YAML.replace(b"max_steps: 10", b"max_steps: :0"))  # a bad value: the file is named
def test_yaml_config(tmp_path_factory, data):
  from jaxsft import config

  read_as_the_cli_does(config.load_yaml, written(tmp_path_factory.mktemp("fuzz"), "train.yaml", data))


def model_config_bytes() -> bytes:
  from jaxsft import models
  from tiny_model import TINY

  return json.dumps(models.to_hf_config(TINY), indent=1).encode()


@FUZZ
@given(data=mutations(model_config_bytes()))
def test_model_config_json(tmp_path_factory, data):
  from jaxsft.models import families

  path = written(tmp_path_factory.mktemp("fuzz"), "config.json", data)
  read_as_the_cli_does(lambda p: families.read_hf_config(p.parent), path)


ADAPTER_CONFIG = json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                             "target_modules": ["q_proj", "v_proj"], "bias": "none", "use_rslora": False,
                             "base_model_name_or_path": "smollm2-135m-instruct"}, indent=1).encode()


@FUZZ
@given(data=mutations(ADAPTER_CONFIG))
@example(data=b"\x80")  # not UTF-8
def test_adapter_config_json(tmp_path_factory, data):
  from jaxsft import lora

  read_as_the_cli_does(lora._read_adapter_config, written(tmp_path_factory.mktemp("fuzz"), "adapter_config.json", data))


# ---------------------------------------------------------------------------------------------
# Weights: safetensors (a model's and an adapter's) and GGUF.


def safetensors_bytes() -> bytes:
  from safetensors.numpy import save

  return save({"model.embed_tokens.weight": np.arange(24, dtype=np.float32).reshape(6, 4),
               "model.norm.weight": np.ones(4, np.float16)})


@FUZZ
@given(data=mutations(safetensors_bytes()))
@example(data=(2**40).to_bytes(8, "little") + b"{}")  # a header length no file holds
@example(data=struct.pack("<Q", 80) + json.dumps(  # a tensor claiming 2**40 elements
    {"w": {"dtype": "F32", "shape": [2**20, 2**20], "data_offsets": [0, 2**42]}}).encode().ljust(80) + b"\0" * 16)
def test_model_safetensors(tmp_path_factory, data):
  from safetensors.numpy import load_file

  from jaxsft.models import loading

  path = written(tmp_path_factory.mktemp("fuzz"), "model.safetensors", data)
  read_as_the_cli_does(lambda p: loading._load_safetensors(p, load_file), path)


@FUZZ
@given(data=mutations(safetensors_bytes()))
def test_adapter_safetensors(tmp_path_factory, data):
  from jaxsft import lora

  read_as_the_cli_does(lora._read_adapter_weights, written(tmp_path_factory.mktemp("fuzz"), "adapter_model.safetensors",
                                                           data))


def gguf_bytes(folder: pathlib.Path, *, vocab_size: int | None = 6) -> bytes:
  """A small llama GGUF: the metadata `gguf_config` reads and two tensors."""
  import gguf

  path = folder / "valid.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  fields = (("llama.block_count", 1), ("llama.embedding_length", 4), ("llama.feed_forward_length", 8),
            ("llama.attention.head_count", 2), ("llama.attention.head_count_kv", 1), ("llama.context_length", 64))
  for name, value in fields + ((("llama.vocab_size", vocab_size),) if vocab_size else ()):
    writer.add_uint32(name, value)
  writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
  writer.add_tensor("token_embd.weight", np.arange(24, dtype=np.float32).reshape(6, 4))
  writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path.read_bytes()


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> bytes:
  return gguf_bytes(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def gguf_without_vocab(tmp_path_factory) -> bytes:
  """No vocab_size and no tokenizer: a KeyError once, now a refusal."""
  return gguf_bytes(tmp_path_factory.mktemp("gguf"), vocab_size=None)


def gguf_huge_tensor() -> bytes:
  """A GGUF whose one tensor claims 2**20 x 2**20 float32 (4 TiB) in a file of a few hundred bytes."""
  name = b"token_embd.weight"
  header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
  info = struct.pack("<Q", len(name)) + name + struct.pack("<I", 2) + struct.pack("<QQ", 2**20, 2**20)
  info += struct.pack("<IQ", 0, 0)  # F32, at offset 0 of the data section
  blob = header + info
  return blob + b"\0" * (-len(blob) % 32) + b"\0" * 64


@FUZZ
@given(data=st.data())
@example(data="huge tensor")
@example(data="no vocabulary")
def test_gguf(tmp_path_factory, valid_gguf, gguf_without_vocab, data):
  from jaxsft.models.gguf import read

  examples = {"huge tensor": gguf_huge_tensor, "no vocabulary": lambda: gguf_without_vocab}
  raw = examples[data]() if isinstance(data, str) else data.draw(mutations(valid_gguf))
  read_as_the_cli_does(read.read_gguf, written(tmp_path_factory.mktemp("fuzz"), "model.gguf", raw))


def test_the_valid_files_read(tmp_path, valid_gguf):
  """The files the fuzzing mutates are valid: a mutation that changes nothing reads."""
  from safetensors.numpy import load_file

  from jaxsft.data import records
  from jaxsft.models import loading
  from jaxsft.models.gguf import read

  for name, data in (("a.json", JSON_ARRAY), ("a.jsonl", JSONL), ("a.jsonl.gz", GZIPPED_JSONL),
                     ("a.parquet", parquet_bytes())):
    assert len(records.load_records(written(tmp_path, name, data))) == 2
  config, tensors = read.read_gguf(written(tmp_path, "a.gguf", valid_gguf))
  assert config["vocab_size"] == 6 and tensors["model.embed_tokens.weight"].shape == (6, 4)
  assert set(loading._load_safetensors(written(tmp_path, "a.safetensors", safetensors_bytes()), load_file)) == {
      "model.embed_tokens.weight", "model.norm.weight"}


# ---------------------------------------------------------------------------------------------
# Chat templates: a model folder's template, mutated, rendering a conversation.

TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def template_tokenizer(tokenizer):
  import copy

  return copy.copy(tokenizer)


@FUZZ
@given(data=mutations(TEMPLATE.encode()))
@example(data=b"{{ ''.__class__.__mro__ }}")  # what the sandbox refuses
@example(data=b"{% for m in messages %}")  # does not compile
def test_chat_template(tmp_path_factory, template_tokenizer, data):
  from jaxsft.data import template

  folder = tmp_path_factory.mktemp("fuzz")
  path = written(folder, "chat_template.jinja", data)

  def render(p):
    template_tokenizer.chat_template = p.read_bytes().decode("utf-8", errors="replace")
    template_tokenizer.name_or_path = str(p.parent)
    template.render_chat(template_tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])

  read_as_the_cli_does(render, path, named=folder.name)
