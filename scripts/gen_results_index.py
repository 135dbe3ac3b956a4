"""Write benchmarks/results/README.md: every result file, the command that made it, its machine,
the date and the commit that last wrote it.

    python scripts/gen_results_index.py

The command is the result's own record of it (the .md's code span under its title, the .json's
"command", a durations file's first line); the machine is what the file states (CPU model and
vector ISA; "not recorded" where the file does not say); the date and commit are git's for the
last change of the file. Files of one run (name.json, name.md, name*.png) share one row.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
NOTES = RESULTS / "performance_notes.md"  # what the runs found, in words: linked from the header, not a run
NOT_RECORDED = "not recorded"
# Results whose files do not name their command; the command is the one that writes them.
KNOWN_COMMANDS = {
    "chunked_loss_memory": "python benchmarks/chunked_loss_memory.py --run",
    "quantized_memory": "python benchmarks/quantized_memory.py sizes | plan8b | step8b [--quantize-embeddings] | speed --reps 3 | error",
    "parity_gpu": "bash benchmarks/gpu.sh (its parity cell: benchmarks/gpu_parity.py)",
    "parity_rehearsal": "bash benchmarks/gpu.sh --rehearse (its parity cell)",
}


def run_name(path: pathlib.Path) -> str:
  """The run a file belongs to: collation_smollm2_k.png belongs to collation_smollm2."""
  stem = path.stem
  if path.suffix == ".png" and stem.endswith("_k") and (RESULTS / f"{stem[:-2]}.json").exists():
    return stem[:-2]
  return stem


def command_of(files: list[pathlib.Path]) -> str:
  name = run_name(files[0])
  by_suffix = {f.suffix: f for f in files}
  if ".json" in by_suffix:
    record = _json(by_suffix[".json"])
    if isinstance(record, dict) and isinstance(record.get("command"), str):
      return record["command"]
  if ".md" in by_suffix:
    for line in by_suffix[".md"].read_text().splitlines()[1:6]:
      match = re.match(r"`([^`]+)`", line.strip())
      if match:
        return match.group(1)
  if ".txt" in by_suffix:
    match = re.search(r"`([^`]+)`", by_suffix[".txt"].read_text().splitlines()[0])
    first = by_suffix[".txt"].read_text().splitlines()[0]
    if "pytest --durations=0" in first:
      return "pytest --durations=0 (" + ("bash .ci/run" if "of `bash .ci/run`" in first else "the working checkout") + ")"
    if match:
      return match.group(1)
  return KNOWN_COMMANDS.get(name, NOT_RECORDED)


def _json(path: pathlib.Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _machine_record(record) -> dict | None:
  """The first {"cpu": ...} mapping in a result (some keep one per section)."""
  if isinstance(record, dict):
    if "cpu" in record:
      return record
    for value in record.values():
      found = _machine_record(value)
      if found:
        return found
  return None


def machine_of(files: list[pathlib.Path]) -> str:
  by_suffix = {f.suffix: f for f in files}
  machine = _machine_record(_json(by_suffix[".json"])) if ".json" in by_suffix else None
  if machine:
    isa = machine.get("vector_isa") or f"vector ISA {NOT_RECORDED}"
    cores = f", {machine['cpus']} cores" if machine.get("cpus") else ""
    return f"{machine['cpu']} ({isa}){cores}"
  if ".md" in by_suffix:
    for line in by_suffix[".md"].read_text().splitlines():
      if line.startswith("Machine: "):
        text = line[len("Machine: "):].split(";")[0]
        return text if "(" in text else text.replace(",", f" (vector ISA {NOT_RECORDED}),", 1)
  if ".txt" in by_suffix:
    first = by_suffix[".txt"].read_text().splitlines()[0]
    cpu = re.search(r"CPU: (.+?) \(grep", first)
    avx512 = re.search(r"AVX-512: (yes|no)", first)
    if cpu:
      isa = {"yes": "AVX-512", "no": "AVX2"}.get(avx512.group(1) if avx512 else "", f"vector ISA {NOT_RECORDED}")
      return f"{cpu.group(1)} ({isa}), 2 cores" if "2 cores" in first else f"{cpu.group(1)} ({isa})"
  return NOT_RECORDED


def last_written(files: list[pathlib.Path]) -> tuple[str, str]:
  """git's date and short hash of the newest commit that changed any of the files."""
  out = subprocess.run(["git", "log", "--format=%ad %h", "--date=short", "-1", "--", *map(str, files)],
                       cwd=ROOT, capture_output=True, text=True, check=False).stdout.split()
  return (out[0], out[1]) if len(out) == 2 else ("uncommitted", "—")


def ignored_by_git(paths: list[pathlib.Path]) -> set[pathlib.Path]:
  """The paths git ignores (the GPU rehearsal's per-cell files, say): a clone never has them, so
  the index must not link them even when this checkout does."""
  out = subprocess.run(["git", "check-ignore", "--stdin"], cwd=ROOT, input="\n".join(map(str, paths)),
                       capture_output=True, text=True, check=False).stdout
  return {pathlib.Path(line) for line in out.splitlines()}


def render() -> str:
  runs: dict[str, list[pathlib.Path]] = {}
  paths = sorted(RESULTS.iterdir())
  ignored = ignored_by_git(paths)
  for path in paths:
    if path.is_file() and path.name not in (INDEX.name, NOTES.name) and path not in ignored:
      runs.setdefault(run_name(path), []).append(path)
  lines = [
      "# Benchmark results",
      "",
      "<!-- Generated by scripts/gen_results_index.py; run it again after adding or rewriting a result. -->",
      "",
      "```bash",
      "python -m benchmarks.matmul --threads 2 --calls 30 --reps 3 --suffix _mine   # writes matmul_mine.json and .md here",
      "python scripts/gen_results_index.py                                          # then lists it below",
      "```",
      "",
      "Every file in this folder, grouped by the run that wrote it: the command (as the file records it),",
      "the machine (CPU model and vector instruction set as the file states them: \"not recorded\" where it",
      "does not), and the date and commit of the file's last change in git. Each `.md` holds the full table",
      "of its run and the load average at its start; its `.json` holds every number. How to run each",
      "benchmark: [docs/performance.md](../../docs/performance.md); what the runs found, machine by machine:",
      f"[{NOTES.name}]({NOTES.name}).",
      "",
      "| result | files | command | machine | last written |",
      "| --- | --- | --- | --- | --- |",
  ]
  for name, files in runs.items():
    date, commit = last_written(files)
    links = " ".join(f"[{f.suffix.lstrip('.')}]({f.name})" if not f.name.endswith("_k.png") else f"[k.png]({f.name})" for f in files)
    command = command_of(files).replace("|", "\\|")
    lines.append(f"| `{name}` | {links} | `{command}` | {machine_of(files)} | {date} {commit} |")
  return "\n".join(lines) + "\n"


def main() -> int:
  INDEX.write_text(render())
  print(f"wrote {INDEX.relative_to(ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
