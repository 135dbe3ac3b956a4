"""The docs say what the code does: docs/options.md is generated from the config and current, and
every command README.md shows is one the CLI accepts (the test command is the one CI runs)."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shlex

import pytest

from jaxsft import chat, cli, config, config_args, doctor, evaluate, export
from jaxsft.data import __main__ as data_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
OPTIONS_PAGE = ROOT / "docs" / "options.md"
# Each command's argument check, without running it: the parse the command's main() starts with.
PARSERS = {"train": config_args.parse_args, "chat": chat.parse_args, "export": export.parse_args,
           "data": data_cli.parse_args, "doctor": doctor.parse_args, "evaluate": evaluate.parse_args}


def _gen_options():
  spec = importlib.util.spec_from_file_location("gen_options", ROOT / "scripts" / "gen_options.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def fenced_shell_lines(text: str) -> list[str]:
  """The lines of every ```bash block, continuation lines joined."""
  lines = []
  for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
    lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
  return lines


def jaxsft_invocations(line: str) -> list[tuple[str, list[str]]]:
  """(command, its arguments) for every `python -m jaxsft.X ...` or `jaxsft X ...` in a shell line
  (after `&&`, `;` or `{` too, or beside another command); a trailing `# comment` is not an argument."""
  words = shlex.split(line, comments=True)
  found = []
  for i, word in enumerate(words):
    if word == "-m" and i > 0 and words[i - 1].endswith("python") and words[i + 1].startswith("jaxsft."):
      name, rest = words[i + 1].split(".", 1)[1], words[i + 2:]
    elif word == "jaxsft" and (i == 0 or words[i - 1] in ("&&", ";", "{")):
      name, rest = (rest := words[i + 1:]) and rest[0], rest[1:]
      if name in ("--help", "-h"):
        found.append(("jaxsft", ["--help"]))
        continue
    else:
      continue
    # A command ends at a shell operator, or where another starts (side-by-side columns of commands).
    end = next((j for j, w in enumerate(rest) if w in ("&&", "&", ";", "}", "|", ">")
                or (w.endswith("python") and rest[j + 1:j + 2] == ["-m"])), len(rest))
    found.append((name, rest[:end]))
  return found


def test_every_config_key_is_in_the_options_page_and_the_page_is_current():
  page = OPTIONS_PAGE.read_text()
  keys = config.fields()
  assert len(keys) > 50
  for key in keys:
    assert f"| `{key}`" in page, f"{key} is missing from docs/options.md"
  assert page == _gen_options().render(), "docs/options.md is out of date: run python scripts/gen_options.py"


def test_a_field_without_a_docstring_shows_in_the_page_as_undocumented(tmp_path, monkeypatch):
  generator = _gen_options()
  source = tmp_path / "config.py"
  source.write_text(generator.CONFIG_SOURCE.read_text().replace(
      '  """Rank of each LoRA update (A is in x r, B is r x out)."""\n', ""))
  monkeypatch.setattr(generator, "CONFIG_SOURCE", source)
  rows = [line for line in generator.render().splitlines() if line.startswith("| `lora.r`")]
  assert len(rows) == 1 and rows[0].endswith("| — Must be >= 1. |"), rows


def _readme_command(marker: str) -> str:
  return next(line for line in fenced_shell_lines(README.read_text()) if marker in line)


def shell_steps(text: str) -> list[str]:
  """The commands of a shell line or script, one per `&&`/`;`/line, without output redirection,
  `|| true` and the HF_HUB_OFFLINE=1 prefix (README sets it per command, .ci/run exports it)."""
  steps = []
  for line in text.splitlines():
    if line.strip().startswith("#"):
      continue
    for part in re.split(r"&&|;", line):
      part = part.replace("> /dev/null", "").replace("|| true", "").strip(" {}")
      if part and not part.startswith(("set ", "cd ", "export ")):
        steps.append(" ".join(part.removeprefix("HF_HUB_OFFLINE=1 ").split()))
  return steps


def test_readmes_test_command_is_the_one_ci_runs():
  ci_script = (ROOT / ".ci" / "run").read_text()
  assert "export HF_HUB_OFFLINE=1" in ci_script and "HF_HUB_OFFLINE=1 " in _readme_command("pytest")
  # .ci/run quiets pip and adds the slowest-test report; otherwise the steps are README's, in order.
  ci = [step.replace(" install -q ", " install ").replace(" --durations=25", "") for step in shell_steps(ci_script)]
  assert shell_steps(_readme_command("pytest")) == ci


def check_arguments(name: str, argv: list[str]) -> None:
  """Parse a command's arguments as its main() would, without running it. A --config file the
  user writes (docs/scaling.md's run.yaml) is not in the repository: the rest is still checked."""
  if name == "jaxsft":
    with pytest.raises(SystemExit) as done:
      cli.main(argv)
    assert done.value.code == 0
    return
  assert name in cli.COMMANDS, f"jaxsft.{name} is not a command"
  if name == "train" and "--config" in argv:
    at = argv.index("--config")
    if not (ROOT / argv[at + 1]).is_file():
      argv = argv[:at] + argv[at + 2:]
  if "--help" in argv:
    with pytest.raises(SystemExit) as done:
      PARSERS[name](argv)
    assert done.value.code == 0, (name, argv)
    return
  PARSERS[name](argv)  # a ConfigError or argparse's exit 2 fails the test with the command in view


def test_readmes_commands_are_ones_the_cli_accepts(monkeypatch, capsys):
  monkeypatch.chdir(ROOT)  # README's paths (configs/alpaca.yaml) are the repository's
  invocations = [call for line in fenced_shell_lines(README.read_text()) for call in jaxsft_invocations(line)]
  assert {name for name, _ in invocations} >= {"train", "chat", "export", "data", "doctor", "jaxsft"}
  for name, argv in invocations:
    check_arguments(name, argv)
  assert "usage:" in capsys.readouterr().out


def test_the_guides_commands_are_ones_the_cli_accepts(monkeypatch):
  monkeypatch.chdir(ROOT)
  checked = 0
  for page in sorted((ROOT / "docs").glob("*.md")):
    for line in fenced_shell_lines(page.read_text()):
      if "..." in line:  # an elided command ("python -m jaxsft.train ..."): nothing to check
        continue
      for name, argv in jaxsft_invocations(line):
        check_arguments(name, argv)
        checked += 1
  assert checked > 20


def test_the_readme_is_short_and_names_no_machine_outside_performance_and_limits():
  text = README.read_text()
  assert len(text.splitlines()) <= 400
  sections = re.split(r"^## ", text, flags=re.M)
  for section in sections:
    title = section.splitlines()[0]
    if title in ("Performance", "Known limits"):
      continue
    for pattern in (r"\b20\d\d-\d\d-\d\d\b", r"EPYC|Xeon"):
      assert not re.search(pattern, section), (title, pattern)


def test_every_help_shows_defaults_and_groups(capsys):
  assert "(default: 256)" in chat.build_parser().format_help()
  assert "(default: 0)" in chat.build_parser().format_help()  # a zero default is shown too
  assert "what to write:" in export.build_parser().format_help()
  train_help = config_args.build_parser().format_help()
  for section in ("model", "lora", "data", "optim", "mesh", "eval", "logging"):
    assert f"\n{section}.* (" in train_help, section


def test_every_relative_link_of_the_readme_and_the_guide_names_a_file_that_exists():
  pages = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md"]
  links = [(page, target) for page in pages
           for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()) if "://" not in target]
  assert len(links) > 30
  missing = [f"{page.relative_to(ROOT)} -> {target}" for page, target in links if not (page.parent / target).exists()]
  assert not missing, missing


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the project's git checkout")
def test_the_results_index_leaves_out_what_git_ignores():
  """A checkout that ran the GPU rehearsal holds its per-cell files, which git ignores and a clone
  never has: the index written there must not link them."""
  spec = importlib.util.spec_from_file_location("gen_results_index", ROOT / "scripts" / "gen_results_index.py")
  index = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(index)
  results = ROOT / "benchmarks" / "results"
  rehearsal, kept = results / "vs_torch_smollm2_f32_rehearsal.md", results / "gpu_rehearsal.md"
  assert index.ignored_by_git([rehearsal, kept]) == {rehearsal}
