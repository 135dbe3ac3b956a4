"""The layers point one way: no import cycle among jaxsft's packages (every import counted, those
inside functions too), the data layer knows nothing of the collation, the models or the trainer and
loads no jax, and quant sits below the models. A package's `__main__` is its command, the top layer:
nothing imports it."""

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxsft"


def module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def unit(module: str) -> str:
  """The part of jaxsft a module belongs to: its subpackage (jaxsft.models.gguf apart from
  jaxsft.models), or the module itself for one directly under jaxsft and for a package's command
  (`python -m jaxsft.data` is jaxsft.data.__main__, above the packages it runs)."""
  if module.endswith(".__main__"):
    return module
  if module == "jaxsft.models.gguf" or module.startswith("jaxsft.models.gguf."):
    return "jaxsft.models.gguf"
  return ".".join(module.split(".")[:2])


def imported(module: str) -> set[str]:
  """The jaxsft modules `module` imports anywhere in its source (functions included)."""
  tree = ast.parse(MODULES[module].read_text())
  here = module if module in PACKAGES else module.rsplit(".", 1)[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1] + ([base] if base else []))
      found.add(base)
      found |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES}
  out = set()
  for name in found:
    while name not in MODULES and "." in name:
      name = name.rsplit(".", 1)[0]
    if name in MODULES and name != "jaxsft":
      out.add(name)
  return out


def unit_graph() -> dict[str, dict[str, str]]:
  """{unit: {unit it imports: one `module -> module` that does}}."""
  graph: dict[str, dict[str, str]] = {}
  for module in MODULES:
    for target in imported(module):
      if unit(module) != unit(target):
        graph.setdefault(unit(module), {}).setdefault(unit(target), f"{module} -> {target}")
  return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
  """One cycle of `graph` as the imports that close it, or None."""
  state: dict[str, int] = {}  # 1: on the path, 2: done
  path: list[str] = []

  def visit(node: str):
    state[node] = 1
    path.append(node)
    for nxt in graph.get(node, {}):
      if state.get(nxt) == 1:
        loop = path[path.index(nxt):] + [nxt]
        return [graph[a][b] for a, b in zip(loop, loop[1:])]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_the_finder_sees_a_cycle_through_a_function_level_import():
  assert find_cycle({"a": {"b": "a.x -> b.y"}, "b": {"a": "b.y -> a.z"}}) == ["a.x -> b.y", "b.y -> a.z"]
  assert find_cycle({"a": {"b": "a -> b"}, "b": {"c": "b -> c"}}) is None
  # an import inside a function counts: load_tokenizer imports the GGUF tokenizer where it needs it
  assert "jaxsft.models.gguf.tokenizer" in imported("jaxsft.models.hub")
  assert {"jaxsft.models.quantized", "jaxsft.config_checks"} <= imported("jaxsft.models.loading")


def test_no_import_cycle_among_the_packages():
  cycle = find_cycle(unit_graph())
  assert cycle is None, "import cycle: " + "; ".join(cycle)


def test_no_module_imports_a_command():
  """What lets a `__main__` stand above the packages: it imports them, they never import it."""
  commands = {m for m in MODULES if m.endswith(".__main__")}
  assert "jaxsft.data.__main__" in commands
  wrong = {m: sorted(imported(m) & commands) for m in MODULES if imported(m) & commands}
  assert not wrong, wrong


def test_data_and_quant_import_nothing_above_them():
  graph = unit_graph()
  # The data library knows nothing of the collation, the models, the step or the trainer; only its
  # command (`python -m jaxsft.data`) loads a tokenizer through jaxsft.models.hub and prices the
  # batching modes with jaxsft.collation.
  library = {m: imported(m) for m in MODULES if unit(m) == "jaxsft.data"}
  above = {"jaxsft.collation", "jaxsft.models", "jaxsft.models.gguf", "jaxsft.quant", "jaxsft.train", "jaxsft.config",
           "jaxsft.step"}
  wrong = {m: sorted(t for t in targets if unit(t) in above) for m, targets in library.items()}
  assert not any(wrong.values()), wrong
  assert set(graph.get("jaxsft.quant", {})) <= {"jaxsft.config_checks", "jaxsft.errors"}, graph["jaxsft.quant"]
  assert set(graph.get("jaxsft.models.gguf", {})) <= {"jaxsft.errors", "jaxsft.io"}, graph["jaxsft.models.gguf"]
  assert set(graph.get("jaxsft.config_checks", {})) <= {"jaxsft.errors"}, graph["jaxsft.config_checks"]


def _loaded_after(code: str) -> str:
  out = subprocess.run([sys.executable, "-c", code + "\nprint(sorted(m for m in ('jax', 'flax') if m in sys.modules))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  return out.stdout.strip().splitlines()[-1]


def test_importing_the_data_package_loads_no_jax():
  subprocess.run([sys.executable, "-c",
                  "import jaxsft.data, sys; assert 'jax' not in sys.modules and 'flax' not in sys.modules"],
                 cwd=ROOT, check=True, timeout=300)
  # its batching names still resolve (they load Grain, and Grain loads jax, on first use)
  assert _loaded_after("import sys\nfrom jaxsft.data import make_batches, BatchPlan") == "['jax']"


def test_the_data_build_command_loads_no_jax(tiny_dir, small_data, tmp_path):
  code = (f"import sys\nfrom jaxsft.data.__main__ import main\n"
          f"assert main(['build', '--data', {str(small_data)!r}, '--model', {str(tiny_dir)!r}, "
          f"'--cache-dir', {str(tmp_path)!r}]) == 0")
  assert _loaded_after(code) == "[]"
  assert any(tmp_path.iterdir())  # the store was built


def test_a_gguf_models_tokenizer_loads_without_torch_as_autotokenizer_would_load_it(tokenizer):
  """The GGUF's cached tokenizer loads as the class jaxsft wrote it as, without AutoTokenizer,
  whose import brings in transformers' model configurations and torch where it is installed."""
  import transformers

  code = "import sys\nfrom jaxsft.models.hub import load_tokenizer\nload_tokenizer('smollm2-135m-instruct')"
  out = subprocess.run([sys.executable, "-c", code + "\nprint('torch' in sys.modules)"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
  assert out.returncode == 0 and out.stdout.split()[-1] == "False", (out.stdout, out.stderr[-2000:])
  from jaxsft.models.hub import resolve_model

  auto = transformers.AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct").cache_dir / "tokenizer"))
  assert type(auto) is type(tokenizer)
  chat = [{"role": "user", "content": "Name 12 cats."}, {"role": "assistant", "content": "No.<|im_end|>"}]
  assert auto.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)
  assert auto.special_tokens_map == tokenizer.special_tokens_map and len(auto) == len(tokenizer)
