"""scripts/gpu_check.py's pure parts, on a CPU: a check's states (out of time apart from failed and skipped), the
resumed run against its twin (weights, the first diverging step), the targets' lines, the report."""

import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402
import gpu_check_report as report  # noqa: E402


@pytest.fixture
def ctx(tmp_path):
    (tmp_path / "logs").mkdir()
    return gpu_check.Context(tmp_path, deadline=time.time() + 60)


def command(ctx, name, code):
    return lambda until: (gpu_check.run(ctx, name, [sys.executable, "-c", code], until)[0] == 0, "done")


def test_a_check_past_its_time_box_is_out_of_time_not_failed(ctx, capsys):
    started = time.time()
    slow = gpu_check.timed(ctx, "slow", "sleeps", 1, command(ctx, "slow", "print('begun', flush=True); "
                                                                          "import time; time.sleep(30)"))
    assert time.time() - started < 10  # killed at its box, not waited for
    failed = gpu_check.timed(ctx, "broken", "exits 3", 10, command(ctx, "broken", "raise SystemExit(3)"))
    fine = gpu_check.timed(ctx, "fine", "exits 0", 10, command(ctx, "fine", "pass"))
    assert (slow.state, failed.state, fine.state) == (report.OUT_OF_TIME, report.FAILED, report.OK)
    assert "begun" in slow.result and slow.box == pytest.approx(1, abs=0.5)
    assert "[gpu-check] slow: out of time" in capsys.readouterr().err
    # exit 2: out of time where the check decides (the resume pairs, the benchmarks); the optional ones are reported
    assert gpu_check.exit_code([fine, slow]) == 0 and gpu_check.exit_code([fine, slow, failed]) == 1
    slow.name = "bench-learner"
    assert gpu_check.exit_code([fine, slow]) == 2


def test_a_check_with_no_time_left_is_skipped_unstarted(ctx):
    ctx.deadline = time.time() + 2  # under MIN_START_S
    check = gpu_check.timed(ctx, "resume-defaults", "never starts", 100, lambda until: pytest.fail("started"))
    assert check.state == report.SKIPPED and "no time left" in check.result
    assert gpu_check.exit_code([check]) == 2
    assert gpu_check.exit_code([gpu_check.skip(ctx, "no-vllm", "vllm", "vLLM is not installed here")]) == 0


def test_the_lora_run_is_skipped_naming_the_carry_script_where_peft_is_missing(ctx, monkeypatch):
    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None if name == "peft" else real(name))
    gpu_check.lora_run(ctx)
    (check,) = ctx.checks
    assert check.name == "run-lora" and check.state == report.SKIPPED
    assert "scripts/gpu-carry-lora.sh" in check.result and (REPO / "scripts" / "gpu-carry-lora.sh").is_file()


def write_metrics(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rows(losses, norms):
    return [{"step": i + 1, "train/loss": loss, "train/grad_norm": norm} for i, (loss, norm) in
            enumerate(zip(losses, norms))]


def test_first_diverging_step_of_two_metrics_files(tmp_path):
    full = write_metrics(tmp_path / "full.jsonl", rows([0.5, 0.25, 0.125, 0.1], [1.0, 2.0, 3.0, 4.0])
                         + [{"step": 4, "eval/pass@1": 0.5}])  # an evaluation row: no loss, not compared
    same = write_metrics(tmp_path / "same.jsonl", rows([0.5, 0.25, 0.125, 0.1], [1.0, 2.0, 3.0, 4.0]))
    assert report.first_diverging_step(full, same) == (None, "loss and grad_norm equal at all 4 steps")
    norm = write_metrics(tmp_path / "norm.jsonl", rows([0.5, 0.25, 0.125, 0.1], [1.0, 2.0, 3.0000001, 4.5]))
    step, detail = report.first_diverging_step(full, norm)
    assert step == 3 and "grad_norm 3.0 vs 3.0000001" in detail and "loss" not in detail
    short = write_metrics(tmp_path / "short.jsonl", rows([0.5, 0.25], [1.0, 2.0]))
    assert report.first_diverging_step(full, short) == (3, "step 3 only in the uninterrupted run")


def test_resume_verdict_names_the_tensors_the_difference_and_the_step(tmp_path):
    import torch
    from safetensors.torch import save_file

    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.tensor([1.0, 1.0, 1.5]), "b": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    weights = report.compare_weights(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert weights == {"tensors": 2, "differ": 1, "largest": 0.5}
    ok, text = report.resume_verdict(weights, (3, "step 3: loss 1 vs 2"), resumed_after=2)
    assert not ok and text.startswith("NOT bitwise equal: 1 of 2 tensors differ, largest absolute difference 5.000e-01")
    assert "first diverging step 3 (after the resume): step 3: loss 1 vs 2; resumed after step 2" in text
    same = report.compare_weights(tmp_path / "a.safetensors", tmp_path / "a.safetensors")
    assert report.resume_verdict(same, (None, "equal"), 2)[0]
    assert report.resumed_after_step("x\n[fgrpo] resumed from /r/checkpoints/step_2: step 2 done, 2 to go\n") == 2


LEARNER = {
    "model": "qwen2_5_1_5b_random", "workload": "16x8x512", "dtype": "bfloat16",
    "fixed": {"median_s": 2.0, "step_s": [2.1, 2.0, 1.9], "tflops": 300.0, "matmul_tflops": 780.0,
              "pct_of_matmul": 38.5, "new_graphs": 0},
    "widths": {"step_s": [1.0, 1.1, 0.9], "median_s": 1.0, "tflops": 250.0, "pct_of_matmul": 32.0, "new_graphs": 1},
    "compile": {"graphs": 4, "recompiles": 1, "compile_s": 50.0, "recompile_reasons": ["size mismatch"]},
    "memory": {"measured": {"weights": 5.7, "state": 23.0, "activations": 6.0, "peak": 29.5},
               "estimate": {"weights": 5.74, "state": 22.96, "activations": 4.8}, "micro_batch_tokens": 12544},
}
TRL = {"model": "qwen2_5_1_5b_random", "workload": "16x8x512", "median_s": 4.1, "learn_s": [4.3, 4.1, 4.1], "tflops": 159.0, "pct_of_matmul": 20.5, "peak_gib": 26.7,
       "micro_batch": 8, "accumulation": 16}


def test_target_lines_pass_fail_and_not_measured():
    lines = report.target_lines(LEARNER, TRL)
    assert lines[0].startswith("- **PASS** learner >= 35% of the card's bf16 matmul rate: 38.5% (2.000 s per step")
    assert lines[1].startswith("- **PASS** ours >= 1.5x TRL's learner speed: 2.05x (TRL 4.100 s / ours 2.000 s")
    assert lines[2].startswith("- **PASS** learner state within 15% of its estimate: measured 23.00 GiB, "
                               "estimate 22.96 GiB, ratio 1.00")
    assert lines[3].startswith("- **FAIL** learner activations within 15% of its estimate: measured 6.00 GiB")
    assert "ratio 1.25" in lines[3] and "12544 token slots" in lines[3]
    slow = report.target_lines(LEARNER | {"fixed": LEARNER["fixed"] | {"pct_of_matmul": 20.0, "median_s": 3.0}}, TRL)
    assert slow[0].startswith("- **FAIL** learner >= 35%") and slow[1].startswith("- **FAIL** ours >= 1.5x")
    missing = report.target_lines(None, None)
    assert len(missing) == 4 and all(line.startswith("- **not measured**") for line in missing)
    assert "TRL's missing" in report.target_lines(LEARNER, None)[1]
    assert report.target_lines(LEARNER, TRL | {"workload": "4x8x64"})[1].startswith("- **not measured** ours")


def test_report_shows_each_state_the_targets_the_benchmark_and_the_failures_logs(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "broken.log").write_text("$ python x\nTraceback\nValueError: the cause\n")
    (tmp_path / "logs" / "slow.log").write_text("$ python y\nstep 1\n")
    checks = [report.Check("fine", "works", report.OK, 12.3, 60, "all good"),
              report.Check("broken", "fails", report.FAILED, 3, 60, "exit 1: ValueError | the cause", "logs/broken.log"),
              report.Check("slow", "sleeps", report.OUT_OF_TIME, 60, 60, "ran past 60 s", "logs/slow.log"),
              report.Check("vllm", "vLLM", report.SKIPPED, 0, None, "vLLM is not installed here")]
    text = report.render_report("gpu-check now", ["GPU: none"], checks, tmp_path, LEARNER, TRL)
    assert "| check | what | result | time (box) | detail |" in text
    assert "| fine | works | ok | 12 s (60 s) | all good |" in text
    assert "| broken | fails | **FAILED** | 3 s (60 s) | exit 1: ValueError / the cause |" in text
    assert "| slow | sleeps | **out of time** | 60 s (60 s) | ran past 60 s |" in text
    assert "| vllm | vLLM | skipped | 0 s | vLLM is not installed here |" in text
    assert "## Targets" in text and "- **PASS** ours >= 1.5x" in text
    assert "## Learner benchmark (qwen2_5_1_5b_random 16x8x512)" in text
    assert "| s per learner step (median) | 2.000 | 4.100 |" in text and "| [2.1, 2.0, 1.9] | [4.1, 4.1] |" in text and "| activations | 6.00 | 4.80 | 1.25 |" in text
    assert "## broken (failed): the end of logs/broken.log" in text and "ValueError: the cause" in text
    assert "## slow (out of time): the end of logs/slow.log" in text and "## vllm" not in text


def test_the_benchmarks_one_line_summaries():
    assert report.learner_line(LEARNER) == (
        "2.000 s per step, 38.5% of bfloat16 matmul; 4 graphs, 1 recompiles (+1 graphs in 3 steps of drawn widths); "
        "state 23.00 GiB (est. 22.96), activations 6.00 GiB (est. 4.80)")
    assert report.trl_line(TRL | {"dtype": "bfloat16"}) == (
        "4.100 s per step, 20.5% of bfloat16 matmul; micro-batch 8 x 16; peak 26.7 GiB")
