"""A prelude for `python -c`: an interpreter where torch can be neither found nor imported, as in
a runtime-only install (tests of the CLIs and of model loading run after it)."""

PRELUDE = """
import importlib.util, sys
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name == "torch" or name.startswith("torch.") else _find(name, package))
class _NoTorch:
  def find_spec(self, name, path=None, target=None):
    if name == "torch" or name.startswith("torch."):
      raise ModuleNotFoundError("torch is hidden in this test")
sys.meta_path.insert(0, _NoTorch())
"""
