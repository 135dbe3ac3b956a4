"""The run directory's layout: `RunFiles` names every file and folder a run writes."""

import logging

import pytest

from test_train import _damage, base_args

from jaxsft.run_files import RunFiles

# The names users, scripts and the docs (docs/outputs.md) know a run's files by.
LAYOUT = {
    "config": "config.json", "heldout": "heldout.json", "metrics": "metrics.jsonl", "lock_file": "run.lock",
    "loss_curve": "loss_curve.png", "doctor_report": "doctor.txt", "evaluation": "evaluation.json",
    "summary": "summary.json", "wandb_run_id": "wandb_run_id", "checkpoints": "checkpoints", "adapter": "adapter",
    "full_model": "model", "damaged_checkpoints": "damaged_checkpoints", "tensorboard": "tensorboard", "wandb": "wandb",
}


def test_the_layout_names_each_file_once_by_its_real_name(tmp_path):
  files = RunFiles(tmp_path / "run")
  layout = files.layout()
  assert {name: path.name for name, path in layout.items()} == LAYOUT
  assert all(path.parent == files.dir for path in layout.values())
  assert len(set(layout.values())) == len(layout)


def test_a_write_outside_the_layout_is_refused(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  files = RunFiles(tmp_path / "run")
  files.dir.mkdir()
  with pytest.raises(ValueError, match="not a file of the run layout"):
    files.write_json("summary.json", {})  # a bare name would land in the working directory
  with pytest.raises(ValueError, match="not a file of the run layout"):
    files.write_text(files.adapter, "")  # a folder of the layout is not a file
  assert list(tmp_path.rglob("*")) == [files.dir]
  files.write_json(files.summary, {"steps": 1})
  assert files.summary.read_text().startswith("{")


@pytest.mark.slow
def test_a_finished_run_holds_only_what_run_files_names(tiny_dir, small_data, tmp_path, train_main):
  """A run with every optional writer on (checkpoints, a damaged one set aside on resume,
  TensorBoard, W&B offline, the closing evaluation): each entry of its folder is one the layout
  names, a file where it names a file and a folder where it names a folder."""
  run = tmp_path / "run"
  steps = ["save_every=1", "eval.eval_every=0", "eval.generate=false"]
  r = train_main(base_args(tiny_dir, small_data, run, "max_steps=2", *steps))
  assert r.returncode == 0, r.stderr
  _damage(run / "checkpoints" / "2")
  level = logging.getLogger("jaxsft").level
  try:
    r = train_main(base_args(tiny_dir, small_data, run, "max_steps=3", "--resume", "save_every=1",
                             "eval.num_prompts=2", "eval.max_new_tokens=2", "logging.tensorboard=true",
                             "logging.wandb=true", "logging.wandb_mode=offline"))
  finally:
    logging.getLogger("jaxsft").setLevel(level)
  assert r.returncode == 0, r.stderr
  files = RunFiles(run)
  layout = files.layout()
  folders = {layout[name] for name in RunFiles.FOLDERS}
  written = sorted(run.iterdir())
  for path in written:
    assert path in layout.values(), f"{path.name} is not named by RunFiles"
    assert path.is_dir() == (path in folders), f"{path.name}: a {'folder' if path.is_dir() else 'file'} here"
  # Every writer ran: all of the layout but the lock (released) and the full model (a LoRA run).
  assert {p.name for p in written} == set(LAYOUT.values()) - {"run.lock", "model"}
