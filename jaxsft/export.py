"""`python -m jaxsft.export`: the tuned model as one standalone model, for transformers or llama.cpp.

    python -m jaxsft.export runs/default --out exported/default-hf                 # HF folder
    python -m jaxsft.export runs/default --out exported/default-gguf --format gguf --dtype q8_0
    python -m jaxsft.export --model smollm2-135m-instruct --adapter runs/default/adapter --out DIR

The LoRA update is merged into the base in float32, W' = W + s · A B (s = alpha / r, or
alpha / √r with rsLoRA), and only then cast to `--dtype`, so the cast rounds once.

- `--format hf`: config.json, generation_config.json, model.safetensors (split into
  model-0000i-of-0000n.safetensors with model.safetensors.index.json past `--max-shard-size`)
  and the tokenizer files with its chat template: `AutoModelForCausalLM.from_pretrained(out)`
  and `AutoTokenizer.from_pretrained(out)` load it without jaxsft.
- `--format gguf`: one `model.gguf` written with the `gguf` package's GGUFWriter: architecture
  metadata, the tokenizer (vocabulary, merges, special ids, chat template) and the tensors in
  llama.cpp's names and layout (q/k rows permuted for the llama architecture, the inverse of
  `jaxsft.models.loading.unpermute_qk`); `q8_0` quantizes the matrices, norms stay float32.

Everything is built in a temporary folder beside `--out` and swapped in whole; an existing
`--out` is refused unless `--overwrite`. Weights are written as safetensors/GGUF, never pickled.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import numpy as np

from jaxsft import quiet

quiet.silence_library_noise()

HF_DTYPES = ("float32", "bfloat16", "float16")
GGUF_DTYPES = HF_DTYPES + ("q8_0",)
EXIT_USAGE = 2


class ExportError(Exception):
  """Bad input (missing run or adapter, adapter for another base, existing --out): exit 2."""


# ---------------------------------------------------------------------------------------------
# The merged model as Hugging Face named tensors.


def merged_state_dict(model) -> dict[str, np.ndarray]:
  """float32 HF-named tensors of `model` with its LoRA (if any) merged in float32."""
  import jax.numpy as jnp

  from jaxsft import lora
  from jaxsft.models import llama

  if model.dtype != jnp.float32:
    raise ValueError("merged_state_dict: load the base in float32 (the merge must not round twice)")
  if lora.lora_settings(model) is not None:
    lora.merge_lora(model)
  return {k: np.asarray(v, np.float32) for k, v in llama.to_hf_state_dict(model).items()}


def cast(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
  import ml_dtypes

  target = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
  return {k: np.ascontiguousarray(v.astype(target)) for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------
# Hugging Face folder.


def generation_config(config, tokenizer) -> dict[str, Any]:
  """generation_config.json: greedy by default, stopping at every end-of-turn id."""
  from jaxsft.generate import stop_token_ids

  class _M:  # stop_token_ids reads model.config
    pass

  holder = _M()
  holder.config = config
  eos = stop_token_ids(tokenizer, holder)
  return {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
          "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.pad_token_id,
          "do_sample": False, "max_length": config.max_position_embeddings}


def write_hf(folder: pathlib.Path, config, tensors: dict[str, np.ndarray], tokenizer, dtype: str,
             max_shard_size: int | str = "5GB") -> None:
  from huggingface_hub import split_state_dict_into_shards_factory
  from safetensors.numpy import save_file

  from jaxsft.models import llama

  hf_config = {**llama.to_hf_config(config), "torch_dtype": dtype, "dtype": dtype}
  (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
  (folder / "generation_config.json").write_text(json.dumps(generation_config(config, tokenizer), indent=2) + "\n")
  split = split_state_dict_into_shards_factory(tensors, get_storage_size=lambda a: a.nbytes,
                                               filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
  for filename, names in split.filename_to_tensors.items():
    save_file({n: tensors[n] for n in names}, str(folder / filename), metadata={"format": "pt"})
  if split.is_sharded:
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": dict(sorted(split.tensor_to_filename.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
  tokenizer.save_pretrained(str(folder))


# ---------------------------------------------------------------------------------------------
# GGUF.

_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's `permute` of q/k rows (rotate-half halves -> interleaved RoPE pairs).

  Rows of each head are reshaped as (2, d/2) and transposed to (d/2, 2); `unpermute_qk` in
  jaxsft.models.loading is its inverse.
  """
  w = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
  return w.swapaxes(1, 2).reshape(weight.shape)


def gguf_tensor_name(hf_name: str) -> str:
  from jaxsft.models.loading import _GGUF_GLOBAL_NAMES, _GGUF_LAYER_NAMES

  globals_ = {v: k for k, v in _GGUF_GLOBAL_NAMES.items()}
  if hf_name in globals_:
    return globals_[hf_name]
  layers = {v: k for k, v in _GGUF_LAYER_NAMES.items()}
  parts = hf_name.split(".")  # model.layers.{i}.<module path>.<leaf>
  if parts[:2] != ["model", "layers"]:
    raise ValueError(f"no GGUF name for tensor {hf_name!r}")
  module = ".".join(parts[3:-1])
  if module not in layers:
    raise ValueError(f"no GGUF name for tensor {hf_name!r}")
  return f"blk.{parts[2]}.{layers[module]}.{parts[-1]}"


def _gguf_tokenizer_fields(tokenizer, source_gguf: str | None) -> dict[str, Any]:
  """tokenizer.* metadata: copied from the source GGUF when there is one, else built from a
  byte-level BPE fast tokenizer (vocabulary, merges, token types, special ids)."""
  fields: dict[str, Any] = {}
  if source_gguf is not None:
    from gguf import GGUFReader

    reader = GGUFReader(source_gguf)
    for key, field in reader.fields.items():
      if key.startswith("tokenizer."):
        fields[key] = (field.contents(), field.types)
    return fields
  spec = json.loads(tokenizer.backend_tokenizer.to_str())
  model = spec["model"]
  if model.get("type") != "BPE":
    raise ExportError(f"GGUF export builds byte-level BPE tokenizers only; this one is {model.get('type')!r} "
                      f"(export --format hf instead)")
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


def write_gguf(path: pathlib.Path, config, tensors: dict[str, np.ndarray], tokenizer, dtype: str,
               source_gguf: str | None, name: str) -> None:
  import gguf
  from gguf import GGMLQuantizationType as Q

  arch = _GGUF_ARCH.get(config.model_type)
  if arch is None or config.sliding_window is not None or config.rope_scaling:
    raise ExportError(f"GGUF export supports llama/qwen2 without sliding window or rope scaling; this model is "
                      f"{config.model_type} (export --format hf instead)")
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_name(name)
  writer.add_context_length(config.max_position_embeddings)
  writer.add_embedding_length(config.hidden_size)
  writer.add_block_count(config.num_layers)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_heads)
  writer.add_head_count_kv(config.num_kv_heads)
  writer.add_key_length(config.head_dim)
  writer.add_value_length(config.head_dim)
  writer.add_rope_dimension_count(config.head_dim)
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_rope_freq_base(config.rope_theta)
  writer.add_vocab_size(config.vocab_size)
  file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
               "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
  writer.add_file_type(file_type)
  writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
  for key, value in _gguf_tokenizer_fields(tokenizer, source_gguf).items():
    if isinstance(value, tuple):  # copied from a GGUF: (value, field types)
      value, types = value
      if types[0] == gguf.GGUFValueType.ARRAY:
        writer.add_array(key, value)
      else:
        writer.add_key_value(key, value, types[0])
    elif isinstance(value, list):
      writer.add_array(key, value)
    elif isinstance(value, str):
      writer.add_string(key, value)
    else:
      writer.add_uint32(key, value)

  for hf_name, value in tensors.items():
    if config.tie_word_embeddings and hf_name == "lm_head.weight":
      continue
    value = np.asarray(value, np.float32)
    if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
      value = permute_qk(value, config.num_heads if ".q_proj." in hf_name else config.num_kv_heads)
    gguf_name = gguf_tensor_name(hf_name)
    if value.ndim == 1 or dtype == "float32":  # norms and biases stay float32, as llama.cpp keeps them
      writer.add_tensor(gguf_name, np.ascontiguousarray(value, np.float32))
    elif dtype == "float16":
      writer.add_tensor(gguf_name, np.ascontiguousarray(value, np.float16))
    else:
      qtype = Q.BF16 if dtype == "bfloat16" else Q.Q8_0
      if qtype == Q.Q8_0 and value.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        writer.add_tensor(gguf_name, np.ascontiguousarray(value, np.float16))  # rows not in 32-blocks
        continue
      writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


# ---------------------------------------------------------------------------------------------
# The command.


def export(model_name: str, adapter: str | None, out: str | pathlib.Path, *, fmt: str = "hf",
           dtype: str = "float32", overwrite: bool = False, max_shard_size: int | str = "5GB") -> pathlib.Path:
  """Merge `adapter` into `model_name` and write it to `out` (see the module docstring)."""
  from jaxsft import lora, run_files
  from jaxsft.models import hub

  out = pathlib.Path(out)
  if fmt not in ("hf", "gguf"):
    raise ExportError(f"--format must be hf or gguf, got {fmt!r}")
  allowed = GGUF_DTYPES if fmt == "gguf" else HF_DTYPES
  if dtype not in allowed:
    raise ExportError(f"--dtype {dtype} is not available for --format {fmt}; choose from {list(allowed)}")
  if out.exists() and not overwrite:
    raise ExportError(f"{out} already exists; pass --overwrite to replace it")
  try:
    source = hub.resolve_model(model_name)
  except (FileNotFoundError, ValueError, KeyError) as e:
    raise ExportError(f"cannot load model {model_name!r}: {e}") from None
  try:
    model, tokenizer = lora.load_with_adapter(model_name, adapter, dtype="float32")
  except ValueError as e:
    raise ExportError(str(e)) from None
  config = model.config
  tensors = merged_state_dict(model)
  del model

  def fill(tmp: pathlib.Path):
    if fmt == "hf":
      write_hf(tmp, config, cast(tensors, dtype), tokenizer, dtype, max_shard_size)
    else:
      source_gguf = str(pathlib.Path(source.path) / source.gguf_file) if source.gguf_file else None
      write_gguf(tmp / "model.gguf", config, tensors, tokenizer, dtype, source_gguf,
                 name=pathlib.Path(model_name).name + ("-tuned" if adapter else ""))

  return run_files.replace_directory(out, fill)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxsft.export", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("run_dir", nargs="?", help="a run directory written by python -m jaxsft.train")
  parser.add_argument("--model", help="the base model (instead of RUN_DIR)")
  parser.add_argument("--adapter", help="a PEFT LoRA adapter directory to merge into --model")
  parser.add_argument("--out", required=True, help="the folder to write (refused if it exists, unless --overwrite)")
  parser.add_argument("--format", choices=("hf", "gguf"), default="hf")
  parser.add_argument("--dtype", choices=GGUF_DTYPES, default="float32",
                      help="weight dtype after the float32 merge (q8_0: GGUF only)")
  parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
  parser.add_argument("--max-shard-size", default="5GB", help="hf: split model.safetensors past this size")
  args = parser.parse_args(argv)
  if (args.run_dir is None) == (args.model is None):
    parser.error("give RUN_DIR or --model (one of them)")
  if args.adapter and args.run_dir:
    parser.error("--adapter goes with --model; a RUN_DIR brings its own adapter")
  from jaxsft.chat import ChatError, resolve_run

  try:
    if args.run_dir:
      source = resolve_run(args.run_dir)
      model_name, adapter = source["model"], source["adapter"]
    else:
      model_name, adapter = args.model, args.adapter
    out = export(model_name, adapter, args.out, fmt=args.format, dtype=args.dtype, overwrite=args.overwrite,
                 max_shard_size=args.max_shard_size)
  except (ExportError, ChatError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE
  size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
  print(f"wrote {out} ({args.format}, {args.dtype}, {size / 2**20:.1f} MiB)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
