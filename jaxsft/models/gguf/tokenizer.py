"""Tokenizers between GGUF and Hugging Face, both ways, without torch: `tokenizer_from_gguf`
builds the fast tokenizer a GGUF file describes; `gguf_tokenizer_fields` gives the `tokenizer.*`
metadata a GGUF file written from a tokenizer holds."""

from __future__ import annotations

import json
from typing import Any

from jaxsft.models.gguf.read import open_gguf


class TokenizerNotConvertible(ValueError):
  """A tokenizer GGUF metadata cannot be built from (not a byte-level BPE fast tokenizer)."""


def _gguf_metadata(path: str) -> dict:
  """Every GGUF key-value pair (arrays as lists), read with the `gguf` package."""
  reader = open_gguf(path)
  return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def tokenizer_from_gguf(path: str):
  """The fast tokenizer a GGUF file describes, built without torch.

  `AutoTokenizer.from_pretrained(dir, gguf_file=...)` reads the file through transformers' GGUF
  reader, which imports torch. This reads the same metadata with the `gguf` package and hands it
  to transformers' own (torch-free) converter, so the result is the tokenizer transformers builds
  (same vocabulary, merges, special tokens and chat template).
  """
  from transformers import PreTrainedTokenizerFast
  from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

  metadata = _gguf_metadata(path)
  groups = {
      group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
      for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()
  }
  tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
  if tokenizer_dict.get("tokenizer_type") == "llama":
    tokenizer_config.setdefault("add_bos_token", True)  # as transformers does for sentencepiece files
  for name, key in mapping._SPECIAL_TOKENS.items():
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
  backend, extra = mapping.convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
  return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def gguf_tokenizer_fields(tokenizer, source_gguf: str | None) -> dict[str, Any]:
  """tokenizer.* metadata: copied from the source GGUF when there is one (as (value, field types)
  pairs), else built from a byte-level BPE fast tokenizer (vocabulary, merges, token types,
  special ids); any other tokenizer is a `TokenizerNotConvertible`."""
  fields: dict[str, Any] = {}
  if source_gguf is not None:
    reader = open_gguf(source_gguf)
    for key, field in reader.fields.items():
      if key.startswith("tokenizer."):
        fields[key] = (field.contents(), field.types)
    return fields
  spec = json.loads(tokenizer.backend_tokenizer.to_str())
  model = spec["model"]
  if model.get("type") != "BPE":
    raise TokenizerNotConvertible(f"GGUF export builds byte-level BPE tokenizers only; this one is "
                                  f"{model.get('type')!r} (export --format hf instead)")
  vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
  tokens = [t for t, _ in vocab]
  for added in spec.get("added_tokens", []):
    while len(tokens) <= added["id"]:
      tokens.append(f"[PAD{len(tokens)}]")
    tokens[added["id"]] = added["content"]
  special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
  user = {a["id"] for a in spec.get("added_tokens", []) if not a.get("special")}
  types = [3 if i in special else 4 if i in user else 1 for i in range(len(tokens))]  # CONTROL, USER_DEFINED, NORMAL
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  fields["tokenizer.ggml.model"] = "gpt2"
  fields["tokenizer.ggml.tokens"] = tokens
  fields["tokenizer.ggml.token_type"] = types
  fields["tokenizer.ggml.merges"] = merges
  for key, token_id in (("bos_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id),
                        ("padding_token_id", tokenizer.pad_token_id), ("unknown_token_id", tokenizer.unk_token_id)):
    if token_id is not None:
      fields[f"tokenizer.ggml.{key}"] = int(token_id)
  if tokenizer.chat_template:
    fields["tokenizer.chat_template"] = tokenizer.chat_template
  return fields
