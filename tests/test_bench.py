"""bench/compare_trl.py: argument handling (fast) and one tiny end-to-end run (vLLM; TRL when installed)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "compare_trl.py"
HAVE_TRL = importlib.util.find_spec("trl") is not None
LABELS = [
    "seconds per step (median)", "sampling s", "scoring s", "learning s", "generated tokens per step",
    "sampler tokens/s (generated)", "learner tokens/s (prompt+completion)", "sampler % of matmul in its dtype",
    "sampler % of bf16 matmul", "learner % of matmul in its dtype", "learner % of bf16 matmul",
    "learner % of fp32 matmul", "peak RSS GiB",
]
POSITIVE = ["step_s", "sample_s", "learn_s", "generated_tokens", "sampler_tok_s", "learner_tok_s",
            "sampler_pct_own", "learner_pct_own", "learner_pct_fp32", "peak_rss_gib"]
# against a bf16 reference only where bf16 ran (a CPU without native bf16 only probes it: None there)
BF16_PCT = ["sampler_pct_bf16", "learner_pct_bf16"]


def load_path(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_module():
    return load_path(SCRIPT)


def test_parse_workload():
    bench = load_module()
    assert bench.parse_workload("4x8x64") == (4, 8, 64)
    for bad in ("4x8", "4x1x64", "axbxc"):
        with pytest.raises(Exception, match="workload"):
            bench.parse_workload(bad)


def test_a_long_workload_leaves_room_for_its_prompts():
    """16x8x512 (the GPU check's) once stopped at fgrpo's prompt-length check: 512 new tokens in a 512-token model."""
    from fgrpo.prepare import prepare

    cfg = load_module().compose_config({"workload": (16, 8, 512), "model": "tiny_random", "steps": 2, "lr": 1e-6,
                                        "sampler": "hf"})
    assert cfg.sampler.max_model_len >= 512 + 64
    prepare(cfg)  # raises ConfigError when a prompt plus 512 tokens does not fit


def test_learner_step_bench_runs_and_prints_its_row():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "learner_step.py"), "--device", "cpu", "--model",
                           "tiny_random", "--workload", "2x4x8", "--steps", "2", "--set", "compile_learner=false",
                           "--dtype", "float32"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = done.stdout.strip().splitlines()[-1]
    assert row.startswith("| cpu | tiny_random 2x4x8 | compile_learner=false |") and "TFLOP/s" in row


def test_missing_trl_says_how_to_install(monkeypatch, capsys):
    bench = load_module()
    monkeypatch.setattr(bench, "trl_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--only", "trl", "--model", "tiny_random", "--workload", "2x2x8", "--steps", "2"])
    assert "pip install 'fgrpo[bench]'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, str(SCRIPT), "--model", "tiny_random", "--workload", "2x2x8", "--steps", "2",
               "--workdir", str(out / "work"), "--out", str(out / "result.json"), "--out", str(out / "result.md")]
    if not HAVE_TRL:
        command += ["--only", "ours"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads((out / "result.json").read_text()), (out / "result.md").read_text(), result.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_tiny_run_ours(tiny_run):
    report, table, stdout = tiny_run
    assert table.strip() in stdout  # the printed table is the written one
    matmul = report["matmul"]
    assert matmul["fp32_flops"] > 0 and matmul["bf16_flops"] > 0
    # measured before and after the runs; the phases are divided by the better reading
    assert len(matmul["readings"]) == 2
    assert matmul["bf16_flops"] == max(r["bf16_flops"] for r in matmul["readings"])
    ours = report["workloads"]["2x2x8"]["ours"]["summary"]
    assert ours["measured_steps"] == 1
    for key in POSITIVE:
        assert ours[key] > 0, key
    for key in BF16_PCT:
        assert (ours[key] is None) == bool(matmul.get("bf16_source")), key
        assert ours[key] is None or ours[key] > 0, key
    assert "## Workload 2x2x8" in table
    assert "FLOPs: learner 6 x (body params" in table  # a full fine-tune: the weights' own gradients counted
    bf16_rows = {"sampler % of bf16 matmul", "learner % of bf16 matmul"}  # a row of None values is left out
    for label in LABELS:
        if label in bf16_rows and matmul.get("bf16_source"):
            assert label not in table, label
            continue
        assert f"| {label} | " in table or f"|   {label} | " in table, label


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_TRL, reason="TRL not installed (pip install 'fgrpo[bench]'): TRL half skipped")
def test_tiny_run_trl(tiny_run):
    report, table, _ = tiny_run
    workload = report["workloads"]["2x2x8"]
    for key in POSITIVE:
        assert workload["trl"]["summary"][key] > 0, key
        assert workload["ratio_trl_over_ours"][key] > 0, key
    # identical work: same prompts, same number of generated tokens (a random model never stops early)
    assert workload["trl"]["summary"]["prompt_tokens_per_sample"] == workload["ours"]["summary"]["prompt_tokens_per_sample"]
    assert workload["trl"]["summary"]["generated_tokens"] == workload["ours"]["summary"]["generated_tokens"] == 2 * 2 * 8
    assert "| metric | ours | trl | TRL / ours |" in table


def test_checkpoint_io_prints_size_and_times(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "checkpoint_io.py"), "--model", "tiny_random",
                           "--repeats", "1", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    median = done.stdout.strip().splitlines()[-1]
    assert median.startswith("median: save ") and " GiB/s written)" in median
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_reward_pool_prints_answers_per_second():
    command = [sys.executable, str(REPO / "bench" / "reward_pool.py"), "--answers", "12", "--repeats", "1",
               "--workers", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-2].startswith("math check, 1 (in-process): ") and " answers/s" in lines[-2]
    assert lines[-1].startswith("math check, 2 workers: ") and "0 deaths, 0 stuck" in lines[-1]
    assert "a user's function: " in lines[-1] and lines[-1].endswith(" samples/s")


def load_bench_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_learner_step_drawn_widths_differ_per_sequence_and_step():
    batch = load_bench_script("learner_step").batch
    fixed = [len(s.completion_ids) for s in batch(2, 4, 16, 4, 100)]
    drawn = [[len(s.completion_ids) for s in batch(2, 4, 16, 4, 100, widths_seed=seed)] for seed in (1, 2)]
    assert fixed == [16] * 8
    assert drawn[0] != drawn[1] and all(1 <= n <= 16 for n in drawn[0] + drawn[1]) and len(set(drawn[0])) > 1
    # the prompts stay the step's (only the completions' lengths are drawn)
    prompts = [s.prompt_ids for s in batch(2, 4, 16, 4, 100)]
    assert [s.prompt_ids for s in batch(2, 4, 16, 4, 100, widths_seed=1)] == prompts


def test_learner_step_json_has_every_number(tmp_path):
    out = tmp_path / "learner.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "learner_step.py"), "--device", "cpu", "--model",
                           "tiny_random", "--workload", "2x4x8", "--steps", "2", "--widths", "2", "--set",
                           "compile_learner=false", "--dtype", "float32", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = done.stdout.strip().splitlines()[-1]
    assert row.startswith("| cpu | tiny_random 2x4x8 | compile_learner=false |") and "drawn widths: 2 steps" in row
    result = json.loads(out.read_text())
    assert len(result["fixed"]["step_s"]) == 1 and len(result["widths"]["step_s"]) == 2  # the first step dropped
    for key in ("median_s", "tflops", "pct_of_matmul", "matmul_tflops"):
        assert result["fixed"][key] > 0, key
    assert result["compile"]["graphs"] == 0 and result["compile"]["recompiles"] == 0  # nothing compiled here
    memory = result["memory"]
    assert memory["measured"] is None and memory["ratio"] is None  # CUDA only
    estimate = memory["estimate"]
    assert estimate["state"] == pytest.approx(estimate["weights"] + estimate["gradients"] + estimate["moments"])
    assert estimate["activations"] > 0 and memory["micro_batch_tokens"] > 0


@pytest.mark.slow  # about 25 s on 2 cores, most of it importing TRL
@pytest.mark.skipif(not HAVE_TRL, reason="TRL not installed (pip install 'fgrpo[bench]')")
def test_trl_learner_step_runs_on_cpu_and_writes_its_json(tmp_path):
    out = tmp_path / "trl.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "trl_learner_step.py"), "--device", "cpu", "--model",
                           "tiny_random", "--workload", "2x4x16", "--steps", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    row = done.stdout.strip().splitlines()[-1]
    assert row.startswith("| cpu | trl ") and "tiny_random 2x4x16 | micro-batch 8 x 1" in row and "TFLOP/s" in row
    result = json.loads(out.read_text())
    assert len(result["learn_s"]) == 2 and result["median_s"] == pytest.approx(result["learn_s"][1], abs=1e-3)
    assert result["micro_batch"] * result["accumulation"] == 8 and result["dtype"] == "float32"
    assert result["tflops"] > 0 and result["pct_of_matmul"] > 0 and result["peak_gib"] is None


def test_trl_learner_step_prepares_trls_batch():
    """The batch as TRL's generation step hands it to its loss: padded ids and masks, advantages, the token count."""
    trl_step = load_bench_script("trl_learner_step")
    from fgrpo.learner.packing import Sequence

    seqs = [Sequence([5, 6], [7, 8, 9], 1.0), Sequence([5], [7], -1.0)]
    inputs = trl_step.prepared_inputs(seqs, "cpu", pad_id=0)
    assert inputs["prompt_ids"].tolist() == [[5, 6], [0, 5]] and inputs["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert inputs["completion_ids"].tolist() == [[7, 8, 9], [7, 0, 0]]
    assert inputs["completion_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert inputs["advantages"].tolist() == [1.0, -1.0] and int(inputs["num_items_in_batch"]) == 4


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_TRL, reason="TRL not installed (pip install 'fgrpo[bench]'): the LoRA pair needs both")
def test_lora_pair_trains_the_same_adapters_in_ours_and_trl(tmp_path, compose):
    from transformers import AutoModelForCausalLM

    from fgrpo.learner.lora import LoraSettings, apply_lora
    from fgrpo.learner.model import resolve_model_folder

    out = tmp_path / "result.json"
    command = [sys.executable, str(SCRIPT), "--model", "tiny_random", "--workload", "2x2x8", "--steps", "2",
               "--lora", "4", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    workload = json.loads(out.read_text())["workloads"]["2x2x8"]
    assert "LoRA rank 4 (alpha 8)" in workload["ours"]["learner"]
    assert "peft LoRA rank 4 (alpha 8)" in workload["trl"]["learner"]
    assert "both train LoRA adapters of rank 4" in result.stdout
    assert "FLOPs: learner 4 x (LoRA" in result.stdout
    # TRL's peft_config adapts the same layers at the same rank: as many trained weights as ours
    model = AutoModelForCausalLM.from_pretrained(resolve_model_folder(compose("model=tiny_random").model))
    ours = apply_lora(model, LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=None))
    assert workload["trl"]["trainable_params"] == ours > 0


def test_a_lora_rank_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        load_module().main(["--lora", "0", "--only", "ours", "--model", "tiny_random", "--workload", "2x2x8"])
    assert "--lora 0: a LoRA rank is >= 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
def test_lora_push_times_both_ways_and_they_sample_the_same_policy(tmp_path):
    out = tmp_path / "push.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "lora_push.py"), "--model", "tiny_random", "--rank", "4",
                           "--workload", "2x2x8", "--steps", "2", "--dtype", "float32", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "| merged | " in done.stdout and "| vllm-lora | " in done.stdout
    results = json.loads(out.read_text())["results"]
    bench = load_path(REPO / "bench" / "lora_push.py")
    for way in ("merged", "vllm-lora"):
        assert len(results[way]["steps"]) == 2 and all(s["tokens"] == 2 * 2 * 8 for s in results[way]["steps"])
    # fp32 both ways: vLLM's LoRA path and the merged push sample the same greedy tokens, and not the base model's
    assert bench.agreement(results["merged"]["greedy"], results["vllm-lora"]["greedy"]) == 1.0
    assert bench.agreement(results["merged"]["base_greedy"], results["merged"]["greedy"]) < 1.0


def test_rank_load_memory_prints_each_ranks_peak_both_ways(tmp_path):
    rows = {}
    for way in ([], ["--each-rank-whole"]):
        out = tmp_path / f"load{len(way)}.json"
        done = subprocess.run([sys.executable, str(REPO / "bench" / "rank_load_memory.py"), "--model", "tiny_random",
                               "--kl", "--json", str(out), *way], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "| 1 |" in done.stdout and "largest non-zero rank's peak RSS / rank 0's" in done.stdout
        rows[bool(way)] = json.loads(out.read_text())["rows"]
    for way_rows in rows.values():
        assert [r["rank"] for r in way_rows] == [0, 1]
        assert all(r["peak_gib"] >= r["rss_after_gib"] > 0 and r["load_s"] > 0 for r in way_rows)
