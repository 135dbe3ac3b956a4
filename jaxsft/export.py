"""`jaxsft export`: the tuned model as one standalone model, for transformers or llama.cpp.

    jaxsft export runs/default --out exported/default-hf                 # HF folder
    jaxsft export runs/default --out exported/default-gguf --format gguf --dtype q8_0
    jaxsft export --model smollm2-135m-instruct --adapter runs/default/adapter --out DIR
    jaxsft export --model smollm2-135m-instruct --quantize nf4 --out DIR    # the base a QLoRA run sees

The LoRA update is merged into the base in float32, W' = W + s · A B (s = alpha / r, or
alpha / √r with rsLoRA), and only then cast to `--dtype`, so the cast rounds once.

- `--format hf`: config.json, generation_config.json, model.safetensors (split into
  model-0000i-of-0000n.safetensors with model.safetensors.index.json past `--max-shard-size`)
  and the tokenizer files with its chat template: `AutoModelForCausalLM.from_pretrained(out)`
  and `AutoTokenizer.from_pretrained(out)` load it without jaxsft.
- `--format gguf`: one `model.gguf` written with the `gguf` package's GGUFWriter, as llama.cpp's
  `convert_hf_to_gguf.py` writes the family (GGUF arch llama for Llama and Mistral, qwen2, qwen3,
  gemma3, smollm3, phi3, olmo2): architecture metadata, the tokenizer (vocabulary, merges,
  special ids, chat template) and the tensors in llama.cpp's names and layout (q/k rows permuted
  for llama and smollm3; Gemma 3 norms as 1 + w; Phi-3's fused attn_qkv and gate_up in ffn_up),
  all of it in `jaxsft.models.gguf`; `q8_0` quantizes the matrices, norms stay float32. A model
  llama.cpp would run differently (`gguf_refusal`: e.g. a Gemma 3 whose sliding pattern, local
  RoPE base or attention scale llama.cpp fixes otherwise, a SmolLM3 whose NoPE layers are not
  every 4th, sliding windows on an arch without them, Llama-3 RoPE scaling) is refused with the
  reason (exit 2).

Everything is built in a temporary folder beside `--out` and swapped in whole; an existing
`--out` is refused unless `--overwrite`, which replaces only an earlier export; an `--out` that
is, contains or lies inside the run, the adapter or the base model folder is refused. Weights
are written as safetensors/GGUF, never pickled.

A run on a quantized base (`model.quantize`, read from RUN_DIR's config.json, or `--quantize`
with `--model`) is merged into the base as it trained on it: the quantized kernels are
dequantized to float32 first, W' = ŵ + s · A B, then cast. Without an adapter this writes the
dequantized base itself, which a plain run can load to check a quantized run against.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import numpy as np

from jaxsft import errors, quiet
from jaxsft.errors import JaxsftError, ModelNotFoundError

quiet.silence_library_noise()

HF_DTYPES = ("float32", "bfloat16", "float16")
GGUF_DTYPES = HF_DTYPES + ("q8_0",)
EXIT_USAGE = errors.EXIT_USAGE


class ExportError(JaxsftError):
  """Bad input (missing run or adapter, adapter for another base, existing --out): exit 2."""


# ---------------------------------------------------------------------------------------------
# The merged model as Hugging Face named tensors.


def merged_state_dict(model) -> dict[str, np.ndarray]:
  """float32 HF-named tensors of `model` with its LoRA (if any) merged in float32."""
  import jax.numpy as jnp

  from jaxsft import lora
  from jaxsft.models import hf_weights

  if model.dtype != jnp.float32:
    raise ValueError("merged_state_dict: load the base in float32 (the merge must not round twice)")
  if lora.lora_settings(model) is not None:
    lora.merge_lora(model)
  return {k: np.asarray(v, np.float32) for k, v in hf_weights.to_hf_state_dict(model).items()}


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

  from jaxsft.models import families

  hf_config = {**families.to_hf_config(config), "torch_dtype": dtype, "dtype": dtype}
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
# GGUF (`jaxsft.models.gguf` writes the file).


def check_gguf(config) -> None:
  """`ExportError` naming the family and the reason when `gguf_refusal` finds one."""
  from jaxsft.models.gguf import gguf_refusal

  reason = gguf_refusal(config)
  if reason is not None:
    raise ExportError(f"GGUF export cannot express this {config.model_type} model: {reason} "
                      f"(export --format hf instead)")


def write_gguf(path: pathlib.Path, config, tensors: dict[str, np.ndarray], tokenizer, dtype: str,
               source_gguf: str | None, name: str) -> None:
  """`tensors` (HF names, float32) as a GGUF file in llama.cpp's conventions for `config`'s
  family (`jaxsft.models.gguf.write_gguf`; refused by `check_gguf` first), with the tokenizer of
  `source_gguf` when the base was one, else `tokenizer`'s."""
  from jaxsft.models import gguf

  check_gguf(config)
  try:
    tokenizer_fields = gguf.gguf_tokenizer_fields(tokenizer, source_gguf)
  except gguf.TokenizerNotConvertible as e:
    raise ExportError(str(e)) from None
  if getattr(tokenizer, "chat_template", None):  # the template trained with, over a source GGUF's own
    tokenizer_fields["tokenizer.chat_template"] = tokenizer.chat_template
  gguf.write_gguf(path, config, tensors, tokenizer_fields, dtype, name)


# ---------------------------------------------------------------------------------------------
# The command.


def _overlaps(a: pathlib.Path, b: pathlib.Path) -> bool:
  """`a` is `b`, contains it or lies inside it (after resolving links and `..`)."""
  a, b = a.resolve(), b.resolve()
  return a == b or a in b.parents or b in a.parents


def is_earlier_export(folder: pathlib.Path) -> bool:
  """`folder` holds what an export writes and nothing a run or a person keeps: files only (no
  subfolder), and a model.gguf or a config.json with safetensors weights."""
  entries = list(folder.iterdir())
  if any(p.is_dir() for p in entries):
    return False
  names = {p.name for p in entries}
  return "model.gguf" in names or ("config.json" in names and any(n.endswith(".safetensors") for n in names))


def check_out(out: pathlib.Path, sources: dict[str, str | None], overwrite: bool) -> None:
  """Refuses an `out` that would destroy what is exported: one that is, contains or lies inside
  a source (the run, its adapter, the base model folder), or an existing `out` that is not an
  earlier export (with --overwrite) or at all (without)."""
  for what, source in sources.items():
    if source is not None and pathlib.Path(source).exists() and _overlaps(out, pathlib.Path(source)):
      raise ExportError(f"--out {out} overlaps the {what} {source} it exports from; choose a folder outside it")
  if not out.exists():
    return
  if not overwrite:
    raise ExportError(f"{out} already exists; pass --overwrite to replace it")
  if not out.is_dir() or (any(out.iterdir()) and not is_earlier_export(out)):
    raise ExportError(f"--overwrite replaces only an earlier export, and {out} is not one (it holds "
                      f"{sorted(p.name for p in out.iterdir())[:8] if out.is_dir() else 'a file'}); "
                      f"choose another --out")


def export(model_name: str, adapter: str | None, out: str | pathlib.Path, *, fmt: str = "hf",
           dtype: str = "float32", overwrite: bool = False, max_shard_size: int | str = "5GB",
           run_dir: str | None = None, quantize: str = "none", quant_block_size: int = 32,
           quantize_embeddings: bool = False, chat_template: str | None = None) -> pathlib.Path:
  """Merge `adapter` into `model_name` and write it to `out` (see the module docstring)."""
  from jaxsft import io, lora, quant
  from jaxsft.models import hub

  out = pathlib.Path(out)
  if fmt not in ("hf", "gguf"):
    raise ExportError(f"--format must be hf or gguf, got {fmt!r}")
  allowed = GGUF_DTYPES if fmt == "gguf" else HF_DTYPES
  if dtype not in allowed:
    raise ExportError(f"--dtype {dtype} is not available for --format {fmt}; choose from {list(allowed)}")
  check_out(out, {"run": run_dir, "adapter": adapter, "model": model_name}, overwrite)
  try:
    source = hub.resolve_model(model_name)
  except ModelNotFoundError:
    raise  # it names the model already
  except (FileNotFoundError, ValueError, KeyError) as e:
    raise ExportError(f"cannot load model {model_name!r}: {e}") from None
  try:
    model, tokenizer = lora.load_with_adapter(model_name, adapter, dtype="float32", quantize=quantize,
                                              quant_block_size=quant_block_size,
                                              quantize_embeddings=quantize_embeddings, chat_template=chat_template)
  except ValueError as e:
    raise ExportError(str(e)) from None
  from jaxsft.data.template import as_trained

  tokenizer = as_trained(tokenizer)  # a base without a chat template: the plain one it trained on
  quant.dequantize_model(model)  # merge into (and write) the base as the quantized run saw it
  config = model.config
  if fmt == "gguf":
    check_gguf(config)  # before the merge: a refused model writes nothing
  tensors = merged_state_dict(model)
  del model

  def fill(tmp: pathlib.Path):
    if fmt == "hf":
      write_hf(tmp, config, cast(tensors, dtype), tokenizer, dtype, max_shard_size)
    else:
      source_gguf = str(pathlib.Path(source.path) / source.gguf_file) if source.gguf_file else None
      write_gguf(tmp / "model.gguf", config, tensors, tokenizer, dtype, source_gguf,
                 name=pathlib.Path(model_name).name + ("-tuned" if adapter else ""))

  with io.naming_the_target(out):
    return io.replace_directory(out, fill)


def build_parser() -> argparse.ArgumentParser:
  from jaxsft.cli import HelpFormatter, add_model_source

  parser = argparse.ArgumentParser(prog="jaxsft export", description=__doc__.split("\n\n")[0],
                                   formatter_class=HelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
  add_model_source(parser)  # a quantized base is dequantized, then merged
  output = parser.add_argument_group("what to write")
  output.add_argument("--out", required=True, help="the folder to write (refused if it exists, unless --overwrite)")
  output.add_argument("--format", choices=("hf", "gguf"), default="hf",
                      help="hf: a Hugging Face folder; gguf: one llama.cpp file")
  output.add_argument("--dtype", choices=GGUF_DTYPES, default="float32",
                      help="weight dtype after the float32 merge (q8_0: GGUF only)")
  output.add_argument("--overwrite", action="store_true", help="replace an existing --out")
  output.add_argument("--max-shard-size", default="5GB", help="hf: split model.safetensors past this size")
  return parser


def parse_args(argv=None) -> argparse.Namespace:
  from jaxsft.cli import check_model_source

  parser = build_parser()
  args = parser.parse_args(argv)
  check_model_source(parser, args)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  return errors.run_cli(lambda: _main(args))


def _main(args) -> int:
  from jaxsft.cli import model_source

  source = model_source(args)
  if source.quantize_embeddings and source.quantize == "none":
    raise ExportError("--quantize-embeddings needs --quantize (int8, nf4, int4 or gguf)")
  out = export(source.model, source.adapter, args.out, fmt=args.format, dtype=args.dtype, overwrite=args.overwrite,
               max_shard_size=args.max_shard_size, run_dir=args.run_dir, quantize=source.quantize,
               quant_block_size=source.quant_block_size, quantize_embeddings=source.quantize_embeddings,
               chat_template=source.chat_template)
  size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
  print(f"wrote {out} ({args.format}, {args.dtype}, {size / 2**20:.1f} MiB)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
