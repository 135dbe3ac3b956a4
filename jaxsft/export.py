"""`python -m jaxsft.export`: the tuned model as one standalone model, for transformers or llama.cpp.

    python -m jaxsft.export runs/default --out exported/default-hf                 # HF folder
    python -m jaxsft.export runs/default --out exported/default-gguf --format gguf --dtype q8_0
    python -m jaxsft.export --model smollm2-135m-instruct --adapter runs/default/adapter --out DIR
    python -m jaxsft.export --model smollm2-135m-instruct --quantize nf4 --out DIR    # the base a QLoRA run sees

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
  for llama and smollm3, the inverse of `jaxsft.models.loading.unpermute_qk`; Gemma 3 norms as
  1 + w; Phi-3's fused attn_qkv and gate_up in ffn_up); `q8_0` quantizes the matrices, norms stay
  float32. A model llama.cpp would run differently (`gguf_refusal`: e.g. a Gemma 3 whose sliding
  pattern, local RoPE base or attention scale llama.cpp fixes otherwise, a SmolLM3 whose NoPE
  layers are not every 4th, sliding windows on an arch without them, Llama-3 RoPE scaling) is
  refused with the reason (exit 2).

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
from jaxsft.errors import JaxsftError

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

# jaxsft model_type -> GGUF `general.architecture` (llama.cpp converts Mistral as llama).
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
              "smollm3": "smollm3", "phi3": "phi3", "olmo2": "olmo2"}


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's `permute` of q/k rows (rotate-half halves -> interleaved RoPE pairs).

  Rows of each head are reshaped as (2, d/2) and transposed to (d/2, 2); `unpermute_qk` in
  jaxsft.models.loading is its inverse.
  """
  w = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
  return w.swapaxes(1, 2).reshape(weight.shape)


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
  """The GGUF name of a Hugging Face tensor name in GGUF architecture `arch`."""
  from jaxsft.models.loading import _GGUF_GLOBAL_NAMES, gguf_layer_names

  globals_ = {v: k for k, v in _GGUF_GLOBAL_NAMES.items()}
  if hf_name in globals_:
    return globals_[hf_name]
  layers = {v: k for k, v in gguf_layer_names(arch).items()}
  parts = hf_name.split(".")  # model.layers.{i}.<module path>.<leaf>
  if parts[:2] != ["model", "layers"]:
    raise ValueError(f"no GGUF name for tensor {hf_name!r}")
  module = ".".join(parts[3:-1])
  if module not in layers:
    raise ValueError(f"no GGUF name for tensor {hf_name!r} in GGUF architecture {arch}")
  return f"blk.{parts[2]}.{layers[module]}.{parts[-1]}"


def gguf_refusal(config) -> str | None:
  """Why `config` has no GGUF file that llama.cpp runs as jaxsft does (None: it has one).

  llama.cpp reads some settings from no key at all (src/llama-model.cpp): Gemma 3's sliding
  pattern (layer i slides iff i % 6 < 5), its sliding layers' RoPE base (10000) and its
  attention scale (1/sqrt(head_dim); 1/sqrt(hidden/heads) at 62 layers), SmolLM3's NoPE layers
  (every 4th). llama, qwen2, qwen3 and smollm3 have no sliding window in llama.cpp (olmo2's is
  OLMo 3's, which jaxsft does not write), and Llama-3 RoPE scaling would need the rope_freqs
  tensor jaxsft does not write.
  """
  from jaxsft.models import loading

  kind = config.model_type
  arch = _GGUF_ARCH.get(kind)
  if arch is None:
    return f"no GGUF architecture for {kind}"
  layers = config.num_layers
  scaling = dict(config.rope_scaling or {})
  if scaling.get("rope_type") not in (None, "linear"):
    return (f"{scaling['rope_type']} RoPE scaling: llama.cpp stores it as a rope_freqs tensor, which jaxsft "
            f"does not write (linear scaling is written)")
  act = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
  if config.hidden_act != act:
    return f"llama.cpp's {arch} uses {act}, this model {config.hidden_act}"
  if arch not in ("llama", "qwen2") and (config.qkv_bias or config.o_bias or config.mlp_bias):
    return f"jaxsft writes {arch} without bias tensors"
  sliding = tuple(w is not None for w in config.layer_windows())
  if arch == "gemma3":
    want = loading.gemma3_sliding_layers(layers)
    if config.sliding_window is None or sliding != want:
      return (f"llama.cpp's gemma3 slides exactly the layers i with i % {loading.GEMMA3_SLIDING_PERIOD} < "
              f"{loading.GEMMA3_SLIDING_PERIOD - 1} (no GGUF key sets the pattern); this model slides "
              f"{[i for i, s in enumerate(sliding) if s]} of {layers}")
    if config.rope_local_theta != loading.GEMMA3_LOCAL_ROPE_BASE:
      return (f"llama.cpp's gemma3 fixes the sliding layers' RoPE base at {loading.GEMMA3_LOCAL_ROPE_BASE:g}; "
              f"this model's is {config.rope_local_theta:g}")
    scalar = loading.gemma3_query_pre_attn_scalar(layers, config.hidden_size, config.num_heads, config.head_dim)
    if config.query_pre_attn_scalar != scalar:
      return (f"llama.cpp's gemma3 scales attention by 1/sqrt({scalar}) (head_dim, or hidden/heads at 62 "
              f"layers) and reads no key for it; this model's query_pre_attn_scalar is "
              f"{config.query_pre_attn_scalar:g}")
  elif arch != "phi3" and config.sliding_window is not None:
    return f"sliding-window attention (window {config.sliding_window}): jaxsft writes {arch} without one"
  if arch == "smollm3":
    rope = config.layer_rope or (True,) * layers
    if rope != loading.smollm3_rope_layers(layers):
      return (f"llama.cpp's smollm3 leaves RoPE out of exactly the layers i with (i + 1) % "
              f"{loading.SMOLLM3_NO_ROPE_STEP} == 0 (no GGUF key sets them); this model leaves it out of "
              f"{[i for i, r in enumerate(rope) if not r]}")
  return None


def _gguf_tokenizer_fields(tokenizer, source_gguf: str | None) -> dict[str, Any]:
  """tokenizer.* metadata: copied from the source GGUF when there is one, else built from a
  byte-level BPE fast tokenizer (vocabulary, merges, token types, special ids)."""
  fields: dict[str, Any] = {}
  if source_gguf is not None:
    from jaxsft.models.loading import open_gguf

    reader = open_gguf(source_gguf)
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


def check_gguf(config) -> None:
  """`ExportError` naming the family and the reason when `gguf_refusal` finds one."""
  reason = gguf_refusal(config)
  if reason is not None:
    raise ExportError(f"GGUF export cannot express this {config.model_type} model: {reason} "
                      f"(export --format hf instead)")


def write_gguf(path: pathlib.Path, config, tensors: dict[str, np.ndarray], tokenizer, dtype: str,
               source_gguf: str | None, name: str) -> None:
  """`tensors` (HF names, float32) as a GGUF file in llama.cpp's conventions for `config`'s
  family (refused by `check_gguf` first)."""
  import gguf
  from gguf import GGMLQuantizationType as Q

  from jaxsft.models import loading

  check_gguf(config)
  arch = _GGUF_ARCH[config.model_type]
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
  writer.add_rope_dimension_count(config.rotary_dim)  # Phi-3: the partial rotary dims
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_rope_freq_base(config.rope_theta)
  if config.rope_scaling:  # linear (gguf_refusal): llama.cpp divides the frequencies by the factor
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(dict(config.rope_scaling)["factor"])
  if arch == "gemma3":
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_freq_base_swa(config.rope_local_theta)  # = llama.cpp's fixed base (gguf_refusal)
  elif arch == "phi3":  # as llama.cpp's converter: 0 for none
    writer.add_sliding_window(config.sliding_window or 0)
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
    if arch in loading.GGUF_PERMUTED_QK_ARCHS and (".q_proj." in hf_name or ".k_proj." in hf_name):
      value = permute_qk(value, config.num_heads if ".q_proj." in hf_name else config.num_kv_heads)
    if arch in loading.GGUF_NORM_PLUS_ONE_ARCHS and hf_name.endswith("norm.weight"):
      value = value + np.float32(1)
    gguf_name = gguf_tensor_name(hf_name, arch)
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
           run_dir: str | None = None, quantize: str = "none", quant_block_size: int = 64) -> pathlib.Path:
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
  except (FileNotFoundError, ValueError, KeyError) as e:
    raise ExportError(f"cannot load model {model_name!r}: {e}") from None
  try:
    model, tokenizer = lora.load_with_adapter(model_name, adapter, dtype="float32", quantize=quantize,
                                              quant_block_size=quant_block_size)
  except ValueError as e:
    raise ExportError(str(e)) from None
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

  return io.replace_directory(out, fill)


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
  parser.add_argument("--quantize", choices=("none", "int8", "nf4", "int4", "gguf"), default=None,
                      help="the base as a run with this model.quantize sees it, dequantized (default: the run's, "
                           "or none)")
  parser.add_argument("--quant-block-size", type=int, default=None, help="model.quant_block_size of that run (64)")
  args = parser.parse_args(argv)
  if (args.run_dir is None) == (args.model is None):
    parser.error("give RUN_DIR or --model (one of them)")
  if args.adapter and args.run_dir:
    parser.error("--adapter goes with --model; a RUN_DIR brings its own adapter")
  return errors.run_cli(lambda: _main(args))


def _main(args) -> int:
  from jaxsft.run_files import resolve_run

  quantize, block = "none", 64
  if args.run_dir:
    source = resolve_run(args.run_dir)
    model_name, adapter = source.model, source.adapter
    quantize, block = source.quantize, source.quant_block_size
  else:
    model_name, adapter = args.model, args.adapter
  quantize = args.quantize or quantize
  block = args.quant_block_size or block
  out = export(model_name, adapter, args.out, fmt=args.format, dtype=args.dtype, overwrite=args.overwrite,
               max_shard_size=args.max_shard_size, run_dir=args.run_dir, quantize=quantize, quant_block_size=block)
  size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
  print(f"wrote {out} ({args.format}, {args.dtype}, {size / 2**20:.1f} MiB)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
