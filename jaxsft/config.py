"""One dataclass tree behind `configs/*.yaml` and the train command line: the schema, its
defaults, YAML and override loading, and (from `jaxsft.config_checks`) its validation.

A YAML file mirrors the tree (`optim: {lr: 1e-4}`); overrides take dotted keys (`optim.lr`) or
the short aliases of the common ones (`lr`, `data`, `model`, ...). Every key is checked: an
unknown key or a value of the wrong type is a `ConfigError` that lists the valid keys, before
anything is loaded or written; `validate` then checks the whole tree. The command line that
feeds this is `jaxsft.config_args`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import types
import typing
from typing import Any

from jaxsft.config_checks import (CHOICES, QUANT_BLOCK_SIZE, RANGES, check_choice, check_data_sources,  # noqa: F401
                                  check_range, validate)  # (config.validate, its tables, check_data_sources: re-exported)
from jaxsft.errors import ConfigError, one_line


DEFAULT_CONFIG = pathlib.Path(__file__).parent / "configs" / "default.yaml"
"""The embedded default run, the base of the command line when no --config is given."""


@dataclasses.dataclass
class ModelConfig:
  name: str = "smollm2-135m-instruct"
  """A short name, a Hugging Face model directory, a hub id or a .gguf file."""
  dtype: str = "auto"
  """Compute and frozen-weight dtype: auto (bfloat16 on a GPU/TPU, float32 on a CPU), float32 or bfloat16; LoRA params and optimizer state stay float32. On a CPU, bfloat16 means bfloat16 weights and products (on the CPU's bf16 units where it has them) with float32 activations between the products; the run's summary names the kernels that ran."""
  quantize: str = "none"
  """QLoRA: store the frozen base's projection kernels block-quantized and dequantize them inside the step, one layer at a time: none, int8, nf4 (QLoRA's NormalFloat), int4, or gguf (a .gguf model's own Q4_0/Q4_1/Q8_0 blocks, as llama.cpp serves them). Embeddings and LM head stay in `dtype` (see quantize_embeddings), norms too; LoRA only (mode=full is refused)."""
  quant_block_size: int = QUANT_BLOCK_SIZE
  """Inputs per quantization block (one float16 scale each) for int8/nf4/int4: 32 costs NF4 4.5 bits a weight, 64 4.25 bits; gguf files fix theirs at 32."""
  quantize_embeddings: bool = False
  """With `quantize`: store the embedding table and LM head in the same format too (blocks along the hidden size; gguf: the file's own token_embd/output blocks). The lookup dequantizes the rows it takes, the LM head is dequantized whole for the logits. Off: they stay in `dtype`."""
  chat_template: str | None = None
  """A Jinja chat template replacing the tokenizer's own: a template file, or a tokenizer folder whose template to take (its chat_template.jinja or tokenizer_config.json's). None: the tokenizer's; a base model without one trains on jaxsft's plain `User:` / `Assistant:` layout. The run's config keeps the path: chat, evaluate and export use the same template, and export writes it with the model."""
  remat: str = "dots_no_batch"
  """What each decoder layer keeps for the backward pass, the rest recomputed: dots_no_batch (the projections' and the attention's outputs; attention scores, norms and activations recomputed: the fastest measured), dots (every matmul output, attention scores too), full (nothing: least memory, one more forward pass), none (all that JAX saves)."""


@dataclasses.dataclass
class LoraConfig:
  r: int = 8
  """Rank of each LoRA update (A is in x r, B is r x out)."""
  alpha: float = 16.0
  """Scale numerator: the update is (alpha / r) * A B (alpha / sqrt(r) with rslora)."""
  dropout: float = 0.0
  """Dropout on the LoRA branch's input during training (0: none)."""
  target_modules: tuple[str, ...] = ("q_proj", "v_proj")
  """Projections of the decoder layers, or all-linear: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj)."""
  rslora: bool = False
  """Scale by alpha/sqrt(r) instead of alpha/r."""
  use_dora: bool = False
  """DoRA (peft's name): also train a magnitude per output of every targeted projection, the adapted
  weight's columns W + s·A B rescaled to it (their norm held constant in the gradient, as peft does).
  Saved in peft's format (lora_magnitude_vector), merged by export. Costs one norm of each adapted
  weight per step."""


@dataclasses.dataclass
class MixSource:
  """One source of `data.mix`: a data file read as `data.path` reads one, with its own field map and
  format, drawn with `weight` (relative to the other sources' weights)."""

  path: str
  weight: float = 1.0
  field_map: dict[str, str] | None = None
  format: str = "auto"


@dataclasses.dataclass
class DataConfig:
  path: str | None = None
  """Training data: JSON/JSONL, CSV/TSV with a header line (.gz too), parquet, Arrow, a folder of
  parquet shards or of `datasets`' save_to_disk. None: jaxsft's built-in synthetic task set."""
  field_map: dict[str, str] | None = None
  """Map of canonical field names to the file's names, e.g. {"output": "response"}."""
  format: str = "auto"
  """The records' format: auto (detected from each record's fields) or one named format."""
  mix: tuple[MixSource, ...] | None = None
  """Several data files mixed by weight, instead of `path`: in YAML a list of {path, weight, field_map, format}
  (field_map and format as for `path`, per source); on the command line `--data.mix a.json=0.7 b.jsonl=0.3`.
  Weights are relative (normalized to sum 1). Each epoch draws the sources interleaved in proportion to their
  weights (Grain's MapDataset.mix), each source in its own shuffled order, and ends when the source with the
  fewest records per unit of weight has given each of its records once; the other sources go on where they
  stopped in the next epoch. Each source holds out its own share of records (`val_fraction`, at most
  max_val_examples / number of sources each, rounded up); validation uses them all, unweighted. summary.json's
  `data_sources` counts each source's examples and trained tokens."""
  val_path: str | None = None
  """Held-out data; without it `val_fraction` of the training records are held out."""
  val_fraction: float = 0.1
  """Share of the training records held out for validation and the closing evaluation when `val_path` is unset."""
  max_val_examples: int = 256
  """At most this many held-out records."""
  on_error: str = "raise"
  """raise: a bad record stops the run; skip: bad records are counted, reported and skipped."""
  synthetic_size: int = 1200
  """Number of generated examples when `path` is None."""
  max_length: int = 512
  """Tokens per example at most; a longer example keeps its first max_length tokens, and one cut
  before its reply is dropped and counted (when none of the training or held-out records keeps a
  reply token, the run stops with an error naming the data)."""
  batching: str = "bucketed"
  """static (pad to max_length) | dynamic (batch max) | bucketed | packed | bucketed_packed (rows of a few
  widths, each packed) | auto (the mode and its buckets or widths the cost model predicts fastest for this
  run, from step and compile timings at warm-up)."""
  num_buckets: int | str = 4
  """Buckets (bucketed packing: widths, at most); auto: as many as pay for their compiles in this run."""
  time_shapes: bool = True
  """Time up to six compiled shapes at warm-up, a call or two each, and fit the collation cost model to
  them (the log's and summary.json's predicted seconds). false: no timing calls; the prediction uses
  the built-in default cost. `auto` times its probe shapes either way."""
  bucket_lengths: tuple[int, ...] | None = None
  """Explicit bucket boundaries; None: chosen from the data to minimize padding."""
  batch_size: int = 8
  """Rows per batch (when `tokens_per_batch` is unset)."""
  tokens_per_batch: int | None = None
  """Token budget per batch: B_k = tokens_per_batch // T_k (overrides batch_size). Fixed widths only: with
  `batching: dynamic` leave it unset (without --config, the embedded default's budget is then dropped)."""
  pad_to_multiple_of: int = 8
  """Batch widths (dynamic padding, probes, the widest bucket) are rounded up to a multiple of this."""
  train_on: str = "all_assistant"
  """all_assistant: every reply is trained; last: only the final reply. A reply whose turn has
  OpenAI's `"weight": 0` is never trained (with last: the final reply of the others)."""
  worker_count: int = 0
  """Grain worker processes that tokenize records as batches are read (0: the main process). The
  trainer tokenizes every record once before step 1, so its pipeline has nothing left for them."""
  cache: bool = True
  """Tokenize a data file once into a memory-mapped token store and reuse it in later runs (false:
  tokenize in memory every run). The built-in synthetic data is always tokenized in memory."""
  cache_dir: str | None = None
  """Where token stores live (None: $JAXSFT_CACHE/tokens, by default ~/.cache/jaxsft/tokens)."""
  seed: int = 0
  """Seed of the built-in data's generation, the held-out split and the shuffle order."""


@dataclasses.dataclass
class OptimConfig:
  lr: float = 2e-4
  """Peak learning rate of AdamW. Without --config, the embedded default's 2e-3 (a LoRA rate for its short
  runs) applies to LoRA runs; `mode: full` without an lr of its own trains at this default."""
  weight_decay: float = 0.0
  """AdamW's decoupled weight decay."""
  b1: float = 0.9
  """AdamW's first-moment decay."""
  b2: float = 0.999
  """AdamW's second-moment decay."""
  eps: float = 1e-8
  """AdamW's epsilon."""
  schedule: str = "cosine"
  """cosine | linear | constant (after warmup)."""
  warmup_steps: int | None = None
  """Linear warmup steps; None: `warmup_ratio` of the run's steps."""
  warmup_ratio: float = 0.05
  """Warmup as a share of the run's optimizer steps (rounded up), when `warmup_steps` is None."""
  max_grad_norm: float = 1.0
  """Global gradient norm the update is clipped to."""
  grad_accum: int = 1
  """Micro-batches per optimizer step; the loss is normalized by their total valid tokens."""


@dataclasses.dataclass
class MeshConfig:
  data: int = -1
  """Data-parallel degree (-1: all devices left after fsdp)."""
  fsdp: int = 1
  """Degree over which frozen weights are sharded."""


@dataclasses.dataclass
class EvalConfig:
  eval_every: int = 20
  """Validation loss every N optimizer steps (and at the end); 0: only at the end."""
  early_stopping_patience: int | None = None
  """Stop after this many evaluations without a better validation loss."""
  generate: bool = True
  """At the end: generate on held-out prompts with the base and the tuned model, score both."""
  num_prompts: int = 24
  """Held-out prompts the closing evaluation generates for and scores."""
  max_new_tokens: int = 16
  """Tokens generated at most per prompt in the closing evaluation. A reference reply longer than this
  cannot be matched; the evaluation says how many are (`references_cut_short`)."""


@dataclasses.dataclass
class LoggingConfig:
  tensorboard: bool = True
  """TensorBoard event files in output_dir/tensorboard: every step's metrics.jsonl scalars (loss, lr,
  grad norm, tokens, throughput, MFU), validation losses, the config and the doctor's verdict as
  text. `tensorboard --logdir runs/` shows every run under runs/ side by side."""
  wandb: bool = False
  """Log the same to Weights & Biases (pip install 'jaxsft[wandb]'); a missing package or a failed
  start is one warning line and the run goes on."""
  wandb_project: str = "jaxsft"
  """The W&B project; the run is named after output_dir's folder."""
  wandb_mode: str = "online"
  """online | offline (a local run under output_dir/wandb, uploaded later by `wandb sync`)."""
  peak_flops: float | None = None
  """Peak FLOP/s of one device, the denominator of MFU; None: from jaxsft.flops.PEAK_FLOPS by the
  device and dtype (none for a CPU: achieved FLOP/s only)."""
  json: bool = False
  """Print the closing summary on stdout as one JSON object (summary.json's) instead of text."""
  quiet: bool = False
  """Errors only on stderr: no progress bar, no log lines, no text summary (--json still prints)."""


@dataclasses.dataclass
class TrainConfig:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
  mode: str = "lora"
  """lora: train LoRA adapters (the `lora` section) and write a PEFT adapter; full: train the model's
  own weights (every param, or the ones `trainable` matches) and write the whole tuned model in
  Hugging Face format (output_dir/model)."""
  trainable: str | None = None
  """mode=full: a regex searched in each parameter's dotted path (layers are stacked, so a path
  names every layer at once: embed_tokens, norm.weight, layers.self_attn.q_proj.kernel,
  layers.mlp.down_proj.kernel, layers.input_layernorm.weight, lm_head); None: every param."""
  output_dir: str = "runs/default"
  """The run directory: metrics, checkpoints, adapter (or model), summary, plots."""
  epochs: int = 1
  """Passes over the training data (when `max_steps` is None)."""
  max_steps: int | None = None
  """Run exactly this many optimizer steps, repeating the data as often as needed (overrides
  `epochs`); None: `epochs` passes over the data."""
  save_every: int = 50
  """Orbax checkpoint (and PEFT adapter) every N steps; 0: only at the end."""
  keep_checkpoints: int = 2
  """Newest checkpoints kept; older ones are deleted."""
  resume: bool = False
  """Continue from the latest checkpoint in output_dir."""
  seed: int = 0
  """Seed of the LoRA factors' initialization and of dropout."""
  compile_cache: str | None = "~/.cache/jaxsft/xla"
  """Persistent XLA compilation cache: a rerun with the same shapes skips compiling (None: off;
  the JAX_COMPILATION_CACHE_DIR environment variable wins)."""
  neftune_noise_alpha: float | None = None
  """NEFTune (TRL's name): while training, add uniform noise U(-a, a), a = alpha / sqrt(L·d), to the
  input embeddings, L a sequence's real (unpadded) length and d the hidden size; TRL's examples use
  5 to 15. None or 0: off. Never in evaluation, generation or export; drawn from `seed` and the
  micro-batch index, so a resumed run draws the same noise."""
  max_nonfinite_steps: int = 3
  """Stop after this many consecutive steps with a non-finite loss or gradient."""
  progress: bool = True
  """Show a progress bar on stderr."""


# Short command-line names for the keys people type most.
ALIASES = {
    "lr": "optim.lr",
    "data": "data.path",
    "val-data": "data.val_path",
    "field-map": "data.field_map",
    "model": "model.name",
    "chat-template": "model.chat_template",
    "output-dir": "output_dir",
    "max-steps": "max_steps",
    "batching": "data.batching",
    "batch-size": "data.batch_size",
    "max-length": "data.max_length",
    "grad-accum": "optim.grad_accum",
    "dtype": "model.dtype",
    "peak-flops": "logging.peak_flops",
    "json": "logging.json",
    "quiet": "logging.quiet",
    "neftune-noise-alpha": "neftune_noise_alpha",
}
def fields(cls=TrainConfig, prefix="") -> dict[str, tuple[Any, str]]:
  """Every leaf key of the tree, dotted, with its type and its doc line."""
  docs = _field_docs(cls)
  out = {}
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    tp = hints[f.name]
    if dataclasses.is_dataclass(tp):
      out.update(fields(tp, f"{prefix}{f.name}."))
    else:
      out[prefix + f.name] = (tp, docs.get(f.name, ""))
  return out


@functools.cache  # parsing the source is slow, and every parse of a command line asks for every class
def _field_docs(cls) -> dict[str, str]:
  """Attribute docstrings (the string literal after a field) from the source."""
  import ast
  import inspect

  try:
    tree = ast.parse(inspect.getsource(cls))
  except (OSError, TypeError):
    return {}
  body = tree.body[0].body
  docs = {}
  for prev, node in zip(body, body[1:]):
    if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
      docs[prev.target.id] = " ".join(str(node.value.value).split())
  return docs


def coerce(key: str, tp, value):
  """Convert `value` (from YAML or a command-line string) to the field's type, or raise."""
  origin = typing.get_origin(tp)
  args = typing.get_args(tp)
  if origin in (typing.Union, types.UnionType):
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
      if type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    for option in inner[:-1]:  # e.g. int | str: a number, else one of the key's words
      try:
        return coerce(key, option, value)
      except ConfigError:
        pass
    return coerce(key, inner[-1], value)
  if tp is MixSource:
    return _mix_source(key, value)
  try:
    if tp is bool:
      if isinstance(value, bool):
        return value
      if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.lower() in ("true", "1", "yes", "on")
      raise ValueError
    if tp is int:
      if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError
      return int(value)
    if tp is float:
      if isinstance(value, bool):
        raise ValueError
      return float(value)
    if tp is str:
      if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError
      value = str(value)
      check_choice(key, value)
      return value
    if origin is tuple:
      if isinstance(value, str):
        value = json.loads(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
      if not isinstance(value, (list, tuple)):
        raise ValueError
      entries = tuple(coerce(key, args[0], v) for v in value)
      if args[0] is MixSource:
        _check_distinct_paths(key, entries)
      return entries
    if origin is dict:
      if isinstance(value, str):
        value = json.loads(value)
      if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError
      return dict(value)
  except ConfigError:
    raise
  except (ValueError, TypeError, json.JSONDecodeError):
    raise ConfigError(f"{key}: {value!r} is not a valid {type_name(tp)}") from None
  raise ConfigError(f"{key}: unsupported type {tp}")


def _mix_source(key: str, value) -> MixSource:
  """One `data.mix` entry from `PATH=WEIGHT` (the command line) or a mapping (YAML, JSON); a malformed
  entry or a weight that is not a finite number > 0 is a ConfigError naming the entry."""
  if isinstance(value, str):
    path, sep, weight = value.rpartition("=")  # the last '=': a path may hold one, a number never does
    if not sep or not path.strip() or not weight.strip():
      raise ConfigError(f"{key}: {value!r} is not PATH=WEIGHT (e.g. a.json=0.7)")
    value = {"path": path.strip(), "weight": weight.strip()}
  if not isinstance(value, dict):
    raise ConfigError(f"{key}: {value!r} is not PATH=WEIGHT or a mapping {{path, weight, field_map, format}}")
  names = [f.name for f in dataclasses.fields(MixSource)]
  unknown = sorted(set(value) - set(names))
  if unknown or "path" not in value:
    what = f"unknown key(s) {unknown}" if unknown else "no path"
    raise ConfigError(f"{key}: {value!r} has {what}; an entry takes {names}")
  hints = typing.get_type_hints(MixSource)
  path = coerce(f"{key}.path", hints["path"], value["path"])
  entry = {}
  for name in names[1:]:
    if name in value:
      try:
        entry[name] = coerce(name, hints[name], value[name])
        if name == "format" and entry[name] not in CHOICES["data.format"]:
          raise ConfigError(f"format: {entry[name]!r} is not one of {list(CHOICES['data.format'])}")
      except ConfigError as e:
        raise ConfigError(f"{key}: {path}: {e}") from None
  source = MixSource(path, **entry)
  import math

  if not (math.isfinite(source.weight) and source.weight > 0):
    raise ConfigError(f"{key}: {path}: weight must be a finite number > 0, got {source.weight}")
  return source


def _check_distinct_paths(key: str, entries: tuple[MixSource, ...]) -> None:
  """Each file once: a file given twice would be two sources of the same records."""
  import os

  seen = {}
  for entry in entries:
    where = os.path.normpath(os.path.abspath(os.path.expanduser(entry.path)))
    if where in seen:
      raise ConfigError(f"{key}: {entry.path} is given twice (also as {seen[where]}); give each file once, "
                        "with the weight of both")
    seen[where] = entry.path


def type_name(tp) -> str:
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "").replace(f"{__name__}.", "")


def apply_overrides(config: TrainConfig, overrides: dict[str, Any], source: str = "command line") -> TrainConfig:
  """Set dotted keys on a copy of `config`; unknown keys raise with the list of valid ones."""
  config = _deepcopy(config)
  valid = fields()
  for key, value in overrides.items():
    key = ALIASES.get(key, key).replace("-", "_")
    if key not in valid:
      raise ConfigError(f"{source}: unknown key {key!r}. Valid keys: {', '.join(sorted(valid))}")
    tp, _ = valid[key]
    obj = config
    *parents, leaf = key.split(".")
    for p in parents:
      obj = getattr(obj, p)
    try:
      value = coerce(key, tp, value)
    except ConfigError as e:  # a file's bad value names the file (the command line's names its key alone)
      if source == "command line":
        raise
      raise ConfigError(f"{source}: {e}") from None
    check_range(key, value, source)
    setattr(obj, leaf, value)
  return config


def _deepcopy(config):
  import copy

  return copy.deepcopy(config)


def flatten_yaml(tree: dict, path: str, prefix: str = "") -> dict[str, Any]:
  """Nested YAML mapping → dotted keys; a section given a non-mapping is an error."""
  out = {}
  sections = {k.rsplit(".", 1)[0] for k in fields() if "." in k}
  for key, value in tree.items():
    dotted = f"{prefix}{key}"
    if dotted in sections:
      if not isinstance(value, dict):
        raise ConfigError(f"{path}: {dotted!r} is a section; give it a mapping, not {value!r}")
      out.update(flatten_yaml(value, path, dotted + "."))
    else:
      out[dotted] = value
  return out


def load_yaml(path: str | pathlib.Path, base: TrainConfig | None = None) -> TrainConfig:
  import yaml

  path = pathlib.Path(path)
  if not path.is_file():
    raise ConfigError(f"config file {path} does not exist")
  try:
    tree = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: not valid YAML: {one_line(e)}") from None
  if not isinstance(tree, dict):
    raise ConfigError(f"{path}: the top level must be a mapping of config keys")
  return apply_overrides(base or TrainConfig(), flatten_yaml(tree, str(path)), source=str(path))


def to_dict(config: TrainConfig) -> dict:
  return dataclasses.asdict(config)


def from_dict(tree: dict) -> TrainConfig:
  return apply_overrides(TrainConfig(), flatten_yaml(tree, "<dict>"), source="<dict>")
