"""The config tree: YAML + flags + key=value, every key checked."""

import pytest

from jaxsft import config as c


def test_defaults_and_overrides_in_every_form():
  cfg = c.parse_args(["--lr", "1e-4", "max_steps=10", "--lora.target_modules", "q_proj,v_proj,o_proj",
                      "--field-map", '{"output": "response"}', "--resume", "data.batching=packed"])
  assert cfg.optim.lr == 1e-4 and cfg.max_steps == 10 and cfg.resume is True
  assert cfg.lora.target_modules == ("q_proj", "v_proj", "o_proj")
  assert cfg.data.field_map == {"output": "response"} and cfg.data.batching == "packed"
  # No --config: the embedded default run, the one default config (it ships in the package).
  assert c.parse_args([]) == c.load_yaml(c.DEFAULT_CONFIG)
  assert c.parse_args([]).data.path is None and c.parse_args([]).optim.lr == 2e-3
  assert c.TrainConfig().optim.lr == 2e-4  # the library default


@pytest.mark.parametrize("argv, words", [
    (["--lrr", "1"], ["unknown option", "--lrr", "optim.lr"]),
    (["optim.lr=abc"], ["optim.lr", "'abc'", "float"]),
    (["data.batching=foo"], ["data.batching", "static", "packed"]),
    (["--epochs", "1.5"], ["epochs", "int"]),
    (["nonsense=1"], ["unknown key 'nonsense'", "optim.lr"]),
    (["runs/a", "justaword"], ["not key=value", "'justaword'", "run folder is 'runs/a'"]),
    (["runs/a", "--output-dir", "runs/b"], ["given twice", "'runs/a'", "'runs/b'"]),
])
def test_bad_keys_and_values_are_clear_errors(argv, words):
  with pytest.raises(c.ConfigError) as e:
    c.parse_args(argv)
  for w in words:
    assert w in str(e.value)


def test_yaml_is_validated_with_the_file_named(tmp_path):
  good = tmp_path / "good.yaml"
  good.write_text("optim:\n  lr: 3.0e-4\n  grad_accum: 2\ndata:\n  batching: dynamic\nmax_steps: 5\n")
  cfg = c.parse_args(["--config", str(good), "--max-steps", "7"])
  assert (cfg.optim.lr, cfg.optim.grad_accum, cfg.data.batching, cfg.max_steps) == (3e-4, 2, "dynamic", 7)
  bad = tmp_path / "bad.yaml"
  bad.write_text("optim:\n  learning_rate: 1\n")
  with pytest.raises(c.ConfigError, match=r"bad\.yaml.*unknown key 'optim\.learning_rate'.*optim\.lr"):
    c.parse_args(["--config", str(bad)])
  section = tmp_path / "section.yaml"
  section.write_text("optim: 5\n")
  with pytest.raises(c.ConfigError, match="section"):
    c.parse_args(["--config", str(section)])


def test_every_key_is_in_help():
  text = c.build_parser().format_help()
  for key in c.fields():
    assert f"--{key}" in text
  assert "--lr" in text and "--data" in text


def test_the_run_folder_is_the_positional_run_dir_or_output_dir_alike():
  assert c.parse_args(["runs/a", "--lr", "1e-4", "max_steps=3"]).output_dir == "runs/a"
  assert c.parse_args(["max_steps=3", "runs/a"]) == c.parse_args(["--output-dir", "runs/a", "max_steps=3"])
  assert c.parse_args(["runs/a", "output_dir=runs/b"]).output_dir == "runs/b"  # key=value wins, as over any flag
  assert c.parse_args([]).output_dir == "runs/default"


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
