"""The config tree: YAML + flags + key=value, every key checked."""

import pytest

from jaxsft import config as c
from jaxsft import config_args


def test_defaults_and_overrides_in_every_form():
  cfg = config_args.parse_args(["--lr", "1e-4", "max_steps=10", "--lora.target_modules", "q_proj,v_proj,o_proj",
                      "--field-map", '{"output": "response"}', "--resume", "data.batching=packed"])
  assert cfg.optim.lr == 1e-4 and cfg.max_steps == 10 and cfg.resume is True
  assert cfg.lora.target_modules == ("q_proj", "v_proj", "o_proj")
  assert cfg.data.field_map == {"output": "response"} and cfg.data.batching == "packed"
  # No --config: the embedded default run, the one default config (it ships in the package).
  assert config_args.parse_args([]) == c.load_yaml(c.DEFAULT_CONFIG)
  assert config_args.parse_args([]).data.path is None and config_args.parse_args([]).optim.lr == 2e-3
  assert c.TrainConfig().optim.lr == 2e-4  # the library default


@pytest.mark.parametrize("argv, words", [
    (["--lrr", "1"], ["unknown option", "--lrr", "optim.lr"]),
    (["optim.lr=abc"], ["optim.lr", "'abc'", "float"]),
    (["data.batching=foo"], ["data.batching", "static", "packed"]),
    (["--epochs", "1.5"], ["epochs", "int"]),
    (["nonsense=1"], ["unknown key 'nonsense'", "optim.lr"]),
    (["runs/a", "justaword"], ["not key=value", "'justaword'", "run folder is 'runs/a'"]),
    (["runs/a", "--output-dir", "runs/b"], ["given twice", "'runs/a'", "'runs/b'"]),
    # A switch's value would otherwise be taken for RUN_DIR: a run folder named 'false'.
    (["--progress", "false"], ["--progress is a switch", "'false'", "--no-progress", "progress=false"]),
    (["runs/a", "--json", "True"], ["--json is a switch", "--no-json", "logging.json=True"]),
])
def test_bad_keys_and_values_are_clear_errors(argv, words):
  with pytest.raises(c.ConfigError) as e:
    config_args.parse_args(argv)
  for w in words:
    assert w in str(e.value)


def test_a_switch_before_the_run_folder_still_reads_it_as_the_run_folder():
  cfg = config_args.parse_args(["--no-progress", "runs/on", "--quiet"])
  assert (cfg.output_dir, cfg.progress, cfg.logging.quiet) == ("runs/on", False, True)


def test_yaml_is_validated_with_the_file_named(tmp_path):
  good = tmp_path / "good.yaml"
  good.write_text("optim:\n  lr: 3.0e-4\n  grad_accum: 2\ndata:\n  batching: dynamic\nmax_steps: 5\n")
  cfg = config_args.parse_args(["--config", str(good), "--max-steps", "7"])
  assert (cfg.optim.lr, cfg.optim.grad_accum, cfg.data.batching, cfg.max_steps) == (3e-4, 2, "dynamic", 7)
  bad = tmp_path / "bad.yaml"
  bad.write_text("optim:\n  learning_rate: 1\n")
  with pytest.raises(c.ConfigError, match=r"bad\.yaml.*unknown key 'optim\.learning_rate'.*optim\.lr"):
    config_args.parse_args(["--config", str(bad)])
  section = tmp_path / "section.yaml"
  section.write_text("optim: 5\n")
  with pytest.raises(c.ConfigError, match="section"):
    config_args.parse_args(["--config", str(section)])


def test_every_key_is_in_help():
  text = config_args.build_parser().format_help()
  for key in c.fields():
    assert f"--{key}" in text
  assert "--lr" in text and "--data" in text


def test_help_names_the_value_a_run_without_config_starts_from():
  """The embedded default sets some keys otherwise than the dataclasses: a run on the user's own data
  without --config starts from it, so --help shows both values."""
  parser = config_args.build_parser()
  help_of = {action.dest: " ".join(action.help.split()) for action in parser._actions}
  assert help_of["optim.lr"].endswith("[float; default 0.0002; without --config 0.002 (default.yaml)]")
  assert config_args.parse_args(["--data", "my.jsonl"]).optim.lr == 0.002
  assert help_of["optim.b1"].endswith("[float; default 0.9]")  # default.yaml leaves it


def test_the_run_folder_is_the_positional_run_dir_or_output_dir_alike():
  assert config_args.parse_args(["runs/a", "--lr", "1e-4", "max_steps=3"]).output_dir == "runs/a"
  assert config_args.parse_args(["max_steps=3", "runs/a"]) == config_args.parse_args(["--output-dir", "runs/a", "max_steps=3"])
  assert config_args.parse_args(["runs/a", "output_dir=runs/b"]).output_dir == "runs/b"  # key=value wins, as over any flag
  assert config_args.parse_args([]).output_dir == "runs/default"


def test_shipped_configs_parse():
  import pathlib

  root = pathlib.Path(__file__).parents[1]
  configs = sorted((root / "configs").glob("*.yaml"))
  assert configs, "configs/ holds at least one real-data config"
  for path in [c.DEFAULT_CONFIG, *configs]:
    c.load_yaml(path)
  # One default config: the packaged one, no second copy (or link) beside the real-data ones.
  assert c.DEFAULT_CONFIG == root / "jaxsft" / "configs" / "default.yaml" and c.DEFAULT_CONFIG.is_file()
  assert not any(path.name == c.DEFAULT_CONFIG.name for path in root.joinpath("configs").rglob("*"))


# ---------------------------------------------------------------------------------------------
# config.validate: every check of a TrainConfig, also for one built in code.


def _built(**changes):
  """A TrainConfig built in code (not read: nothing has checked it yet), with dotted-key changes."""
  cfg = c.TrainConfig()
  for key, value in changes.items():
    *parents, leaf = key.split("__")
    obj = cfg
    for p in parents:
      obj = getattr(obj, p)
    setattr(obj, leaf, value)
  return cfg


@pytest.mark.parametrize("changes, message", [
    ({"model__quantize_embeddings": True}, r"model\.quantize_embeddings=true needs a model\.quantize format"),
    ({"model__quantize": "nf4", "mode": "full"}, r"model\.quantize=nf4: a quantized base is frozen"),
    ({"mode": "full", "trainable": "layers.(q_proj"}, r"trainable: 'layers.\(q_proj' is not a valid regex"),
    ({"data__batching": "dynamic", "data__tokens_per_batch": 4096}, r"data\.tokens_per_batch needs a fixed width"),
    ({"data__bucket_lengths": (64, 128), "data__max_length": 256}, r"data\.bucket_lengths: the largest bucket \(128\)"),
    ({"lora__r": 0}, r"config: lora\.r must be >= 1, got 0"),
    ({"optim__lr": float("nan")}, r"config: optim\.lr must be a finite number"),
    ({"mode": "partial"}, r"mode: 'partial' is not one of \['lora', 'full'\]"),
    ({"data__num_buckets": "many"}, r"data\.num_buckets: 'many' is not one of \['auto'\]"),
])
def test_validate_refuses_a_bad_config_naming_the_key(changes, message):
  with pytest.raises(c.ConfigError, match=message):
    c.validate(_built(**changes))


def test_validate_passes_the_defaults_the_embedded_run_and_the_shipped_configs():
  import pathlib

  c.validate(c.TrainConfig())
  c.validate(config_args.parse_args([]))
  for path in sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml")):
    c.validate(c.load_yaml(path))
  # lora mode does not read `trainable`, so it is not compiled there
  c.validate(_built(trainable="(unclosed"))


def test_the_command_line_runs_validate():
  with pytest.raises(c.ConfigError, match=r"model\.quantize=int8: a quantized base is frozen"):
    config_args.parse_args(["mode=full", "--model.quantize", "int8"])
  with pytest.raises(c.ConfigError, match=r"data\.tokens_per_batch needs a fixed width"):
    config_args.parse_args(["data.batching=dynamic", "data.tokens_per_batch=512"])


@pytest.mark.parametrize("argv", [["--batching", "dynamic"], ["batching=dynamic"], ["--data.batching=dynamic"]])
def test_dynamic_padding_without_config_drops_only_the_embedded_token_budget(argv):
  assert config_args.parse_args([]).data.tokens_per_batch == 1024  # what default.yaml sets
  cfg = config_args.parse_args(argv + ["--batch-size", "4"])
  assert (cfg.data.batching, cfg.data.tokens_per_batch, cfg.data.batch_size) == ("dynamic", None, 4)
  assert config_args.parse_args(argv).data.batch_size == c.TrainConfig().data.batch_size
  # the other modes keep the embedded budget
  assert config_args.parse_args(["--batching", "static"]).data.tokens_per_batch == 1024


@pytest.mark.parametrize("argv", [["--mode", "full"], ["mode=full"]])
def test_full_fine_tuning_without_config_drops_only_the_embedded_lora_rate(argv, tmp_path):
  assert config_args.parse_args([]).optim.lr == 2e-3  # what default.yaml sets, for its LoRA runs
  assert config_args.parse_args(argv).optim.lr == c.TrainConfig().optim.lr == 2e-4
  assert config_args.parse_args(argv + ["--lr", "1e-5"]).optim.lr == 1e-5
  assert config_args.parse_args(argv + ["optim.lr=3e-3"]).optim.lr == 3e-3  # the user's own, kept
  own = tmp_path / "own.yaml"
  own.write_text("optim:\n  lr: 5.0e-3\n")
  assert config_args.parse_args(["--config", str(own)] + argv).optim.lr == 5e-3


def test_dynamic_padding_keeps_a_token_budget_the_user_set_and_refuses_it(tmp_path):
  with pytest.raises(c.ConfigError, match=r"data\.tokens_per_batch needs a fixed width"):
    config_args.parse_args(["--batching", "dynamic", "--data.tokens_per_batch", "2048"])
  own = tmp_path / "own.yaml"
  own.write_text("data:\n  tokens_per_batch: 1024\n")
  with pytest.raises(c.ConfigError, match=r"data\.tokens_per_batch needs a fixed width"):
    config_args.parse_args(["--config", str(own), "--batching", "dynamic"])


def test_train_validates_a_config_built_in_code_before_writing_anything(tmp_path):
  from jaxsft.train import train

  cfg = _built(model__quantize_embeddings=True, output_dir=str(tmp_path / "run"))
  with pytest.raises(c.ConfigError, match=r"model\.quantize_embeddings=true"):
    train(cfg)
  assert not (tmp_path / "run").exists()


def test_each_list_of_choices_is_one_object_the_rest_import():
  from jaxsft import chat, config_checks, export, quant
  from jaxsft.data import pipeline, records, template

  assert quant.QUANTIZE_CHOICES is config_checks.QUANTIZE_CHOICES is c.CHOICES["model.quantize"]
  assert (records.FORMATS, records.ON_ERROR, template.TRAIN_ON, pipeline.BATCHING) == (
      config_checks.FORMATS, config_checks.ON_ERROR, config_checks.TRAIN_ON, config_checks.BATCHING)
  assert pipeline.BATCHING is config_checks.BATCHING and records.FORMATS is config_checks.FORMATS
  for parser in (chat.build_parser(), export.build_parser()):
    quantize = next(a for a in parser._actions if "--quantize" in a.option_strings)
    assert tuple(quantize.choices) == config_checks.QUANTIZE_CHOICES


def test_checks_that_need_a_runtime_fact_raise_the_same_config_error(tmp_path):
  """The mesh against the devices, gguf blocks against the model's file: where the fact is known,
  as a ConfigError naming the key like validate's."""
  import json

  import jax

  from jaxsft import sharding
  from jaxsft.models import families, loading
  from tiny_model import TINY

  too_many = jax.device_count() + 1
  with pytest.raises(c.ConfigError, match=rf"mesh: data={too_many} × fsdp=1 = {too_many} devices"):
    sharding.make_mesh_context(c.MeshConfig(data=too_many))
  (tmp_path / "config.json").write_text(json.dumps(families.to_hf_config(TINY)))
  with pytest.raises(c.ConfigError, match=r"model\.quantize=gguf keeps a GGUF file's own blocks"):
    loading.load_causal_lm(str(tmp_path), quantize="gguf")


def test_validate_holds_the_data_sources_rule():
  with pytest.raises(c.ConfigError, match=r"data\.mix is empty"):
    c.validate(_built(data__mix=()))
  with pytest.raises(c.ConfigError, match=r"data\.mix and data\.path are both set"):
    c.validate(_built(data__mix=(c.MixSource("a.json"),), data__path="b.json"))
