"""End-to-end runs of `python run.py` (the real CLI, Hydra, model, samplers, W&B offline files)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fgrpo.config import DEFAULT_LR
from fgrpo.infra.run_files import read_metrics
from wandb_files import read_wandb_history, read_wandb_run

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model=tiny_random", "trainer.steps=2", "trainer.prompts_per_step=2", "algo.group_size=4",
    "eval.n_samples=4", "eval.max_problems=4", "eval.every=1", "sampler.max_new_tokens=8",
]
# the compiled learner (the CPU's choice for runs of 40 updates or more) costs a run about 40 s of compiling on a
# 2-core CPU: the runs here that are not about it take the eager one (the compiled one: the hf run below and
# tests/test_resume.py)
EAGER = "hardware.compile_learner=false"
COMPILED = "hardware.compile_learner=true"
TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=1024)  # conf/model/tiny_random.yaml
STEP_KEYS = [
    "train/reward_mean", "train/frac_all_correct", "train/frac_all_wrong", "train/frac_mixed",
    "train/success_rate_hist", "train/focal_weight_mean", "train/focal_weight_min", "train/adv_abs_mean",
    "train/loss", "train/clip_frac_low", "train/clip_frac_high", "train/approx_kl", "train/entropy",
    "train/completion_len_mean", "train/completion_len_max", "train/truncated_frac",
    "perf/sampler_tokens_per_s", "perf/learner_tokens_per_s", "perf/step_time_s", "perf/verify_time_s",
    "train/reward/numeric", "train/reward_errors", "train/skipped_prompts",
]


def run_cli(run_dir: Path, *overrides: str, env: dict | None = None, timeout: int = 900, python=None):
    command = [python or sys.executable, str(REPO / "run.py"), f"hydra.run.dir={run_dir}", *overrides]
    full_env = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def load_state(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def initial_tiny_state() -> dict:
    from fgrpo.learner.model import random_folder

    return load_state(random_folder(TINY_SHAPE, seed=0))


@pytest.mark.parametrize(
    "sampler",
    ["hf", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])],
)
def test_two_steps_on_tiny_random_change_all_parameters(tmp_path, sampler):
    # a random model earns no reward, so the policy-gradient term is 0 here; a small entropy bonus
    # (weight decay off) makes every parameter's gradient non-zero through the same learner path
    result = run_cli(tmp_path, *TINY, f"sampler={sampler}", "algo=cispo", "focal.gamma=1.0", "trainer.lr=1e-3",
                     "trainer.warmup_steps=0", "trainer.weight_decay=0", "algo.entropy_coef=0.01",
                     "trainer.save_final=true", "logger=none", EAGER if sampler == "vllm" else COMPILED)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in STEP_KEYS:
        assert key in steps[0], key
    assert len(steps[0]["train/success_rate_hist"]) == 2
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/arithmetic/pass@4"} <= set(evals[-1])
    assert (tmp_path / "pass_at_k.png").stat().st_size > 10_000
    assert settled_dtypes(tmp_path)[1] in ("float32", "bfloat16")
    before, after = initial_tiny_state(), load_state(tmp_path / "final_model")
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters that did not change: {unchanged}"


@pytest.mark.parametrize(
    "sampler",
    ["hf", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])],
)
def test_a_lora_run_trains_adapters_and_saves_the_merged_model(tmp_path, sampler):
    """model.lora.rank: the adapters train (the entropy bonus gives a random model a gradient), each sampler takes
    the merged weights, and the final model is a plain HF folder whose projections moved and nothing else."""
    result = run_cli(tmp_path, *TINY, f"sampler={sampler}", "model.lora.rank=4", "trainer.lr=1e-2",
                     "trainer.warmup_steps=0", "trainer.weight_decay=0", "algo.entropy_coef=0.01",
                     "trainer.save_final=true", "logger=none", EAGER)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LoRA rank 4 on every linear layer" in (tmp_path / "run.log").read_text()
    before, after = initial_tiny_state(), load_state(tmp_path / "final_model")
    assert after.keys() == before.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {name for name in before if name.endswith("_proj.weight")}


def test_eval_before_false_skips_only_the_evaluation_of_the_starting_weights(tmp_path):
    result = run_cli(tmp_path, *TINY, "sampler=hf", "logger=none", "eval.before=false", EAGER)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/pass@1" in r]
    assert evals == [1, 2]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "eval/pass@1" in summary and not any(key.endswith("_before") for key in summary)
    assert (tmp_path / "pass_at_k.png").stat().st_size > 10_000  # the after-training curve alone


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("dtype, tolerance", [("float32", 2e-3), ("bfloat16", 0.08)])
def test_vllm_logprobs_match_learner_after_weight_update(dtype, tolerance):
    """After pushing new weights, vLLM's log-probs of its own samples equal the learner's recomputation."""
    from fgrpo.learner.packing import Sequence
    from fgrpo.learner.forward import completion_logprobs
    from fgrpo.learner.model import load_policy, load_tokenizer, random_folder
    from fgrpo.rollout.samplers import VLLMSampler

    folder = random_folder(TINY_SHAPE, seed=0)
    tokenizer = load_tokenizer(folder)
    policy = load_policy(folder, dtype="float32", device="cpu")
    sampler = VLLMSampler(folder, dtype=dtype, max_model_len=256, seed=0, device="cpu", kv_cache_gib=1)
    prompts = [tokenizer(f"What is {a} + {a}?")["input_ids"] for a in range(4)]
    try:
        # move the weights far from the ones vLLM loaded: a few large AdamW steps
        optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-2)
        for _ in range(3):
            batch = [Sequence(p, [5, 6, 7, 8]) for p in prompts]
            logp, mask, _ = completion_logprobs(policy, batch, pad_id=tokenizer.pad_token_id)
            optimizer.zero_grad()
            (-(logp * mask).sum()).backward()
            optimizer.step()

        def gap():
            groups = sampler.generate(prompts, 4, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=1)
            seqs = [Sequence(p, c.token_ids) for p, g in zip(prompts, groups) for c in g]
            sampled = [torch.tensor(c.logprobs) for g in groups for c in g]
            with torch.no_grad():
                learner, mask, _ = completion_logprobs(policy, seqs, pad_id=tokenizer.pad_token_id)
            return max((learner[i, : len(s)] - s).abs().max().item() for i, s in enumerate(sampled))

        stale = gap()
        sampler.update_weights(policy)
        synced = gap()
        # between rounds the KV cache's pages go back and the packed weights are dropped: resident memory
        # falls, sampling refuses until the next push, and after it the samples are scored right (a
        # zeroed prefix or a weight left zeroed would shift every log-prob)
        rss_before = _resident_bytes()
        released = sampler.release_memory()
        rss_drop = rss_before - _resident_bytes()
        with pytest.raises(RuntimeError, match="update_weights"):
            sampler.generate(prompts, 1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=1)
        sampler.update_weights(policy)
        after_release = gap()
    finally:
        sampler.close()
    assert synced < tolerance, f"vLLM ({dtype}) log-probs differ from the learner's by {synced} after the push"
    assert stale > 10 * tolerance, f"before the push the gap was only {stale}: the test would not notice a failed push"
    assert released > 0.9 * 2**30, f"released {released} bytes of a 1 GiB KV cache"
    assert rss_drop > 0.5 * 2**30, f"resident memory fell by only {rss_drop / 2**20:.0f} MiB after the release"
    assert after_release < tolerance, f"after the release and a push vLLM's log-probs are off by {after_release}"


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.vllm
def test_default_model_and_sampler_two_steps_write_metrics_and_wandb_files(tmp_path):
    result = run_cli(tmp_path, "trainer.steps=2", "trainer.prompts_per_step=4", "eval.max_problems=8",
                     "eval.n_samples=4", "eval.every=0", "trainer.weight_decay=0", "trainer.warmup_steps=0",
                     "trainer.save_final=true")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    # real rewards (SmolLM2 is right ~25% of the time): mixed groups, non-zero advantages, and the
    # policy gradient alone (no weight decay) moved every parameter
    steps = [r for r in rows if "train/loss" in r]
    assert any(r["train/frac_mixed"] > 0 and r["train/adv_abs_mean"] > 0 for r in steps)
    from fgrpo.learner.model import bundled_folder

    before, after = load_state(bundled_folder()), load_state(tmp_path / "final_model")
    assert not [name for name in before if torch.equal(before[name], after[name])]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(0.0 <= r["eval/pass@1"] <= r["eval/pass@4"] <= 1.0 for r in evals)
    history = read_wandb_history(tmp_path)
    wandb_evals = [h for h in history if "eval/pass@1" in h]
    assert len(wandb_evals) == 2
    for jsonl_row, wandb_row in zip(evals, wandb_evals):
        assert wandb_row["eval/pass@1"] == pytest.approx(jsonl_row["eval/pass@1"])
        assert wandb_row["eval/pass@4"] == pytest.approx(jsonl_row["eval/pass@4"])
    assert any("train/reward_mean" in h for h in history)
    # auto settled on this CPU: the same dtypes in the saved config and the W&B config, with the probe behind them
    config = read_wandb_run(tmp_path).config
    autocast, sampler = settled_dtypes(tmp_path)
    assert (config["hardware"]["autocast_dtype"], config["hardware"]["sampler_dtype"]) == (autocast, sampler)
    assert config["precision"]["rates"]["fp32"] > 0 and "GFLOP/s" in config["precision"]["reason"]


def settled_dtypes(run_dir: Path) -> tuple:
    """(autocast, sampler) dtype as the run's saved config records them: what ran, never `auto`."""
    from omegaconf import OmegaConf

    hardware = OmegaConf.load(run_dir / ".hydra" / "config.yaml").hardware
    assert hardware.autocast_dtype in (None, "bfloat16") and hardware.sampler_dtype in ("float32", "bfloat16")
    assert "precision: learner matmuls in" in (run_dir / "run.log").read_text()  # logged with its reason
    return hardware.autocast_dtype, hardware.sampler_dtype


def run_bad(tmp_path, *overrides, env=None):
    result = run_cli(tmp_path, "model=tiny_random", "logger=none", *overrides, env=env, timeout=120)
    assert result.returncode != 0
    return result.stderr


def test_bad_gamma_group_size_lr_fail_before_model_loads(tmp_path):
    stderr = run_bad(tmp_path, "focal.gamma=-1", "algo.group_size=1", "trainer.lr=0")
    assert "focal.gamma=-1.0: must be >= 0" in stderr
    assert "algo.group_size=1: must be >= 2" in stderr
    assert "trainer.lr=0.0: must be > 0" in stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_correction_keys_fail_before_model_loads(tmp_path):
    stderr = run_bad(tmp_path, "algo.rollout_correction=tis", "algo.correction_high=0.5")
    assert "algo.rollout_correction='tis': must be one of" in stderr and "algo.correction_high=0.5" in stderr
    assert "Traceback" not in stderr and not (tmp_path / "metrics.jsonl").exists()


def test_unknown_group_option_lists_choices(tmp_path):
    stderr = run_bad(tmp_path, "algo=ppo")
    assert "Could not find 'algo/ppo'" in stderr and "cispo" in stderr and "dapo" in stderr


def test_missing_dataset_file_and_row_without_answer(tmp_path):
    missing = tmp_path / "nope.jsonl"
    stderr = run_bad(tmp_path / "a", "dataset=local", f"dataset.train.path={missing}", f"dataset.eval.0.path={missing}")
    assert str(missing) in stderr and "does not exist" in stderr
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?"}\n')
    stderr = run_bad(tmp_path / "b", "dataset=local", f"dataset.train.path={broken}", f"dataset.eval.0.path={broken}")
    assert str(broken) in stderr and "line 2 has no usable answer" in stderr


def test_hub_model_without_network_says_pass_a_local_path(tmp_path):
    stderr = run_bad(tmp_path, "model=qwen2_5_7b", env={"HF_HUB_OFFLINE": "1"})
    assert "Qwen/Qwen2.5-7B" in stderr and "model.path=" in stderr and "no network" in stderr


def hiding_vllm(tmp_path: Path) -> dict:
    """The environment of a process that cannot import vLLM: the only way to cause "not installed" on a machine that
    has it (tests/test_setup.py builds a venv without it)."""
    hide_vllm = tmp_path / "hide_vllm"
    hide_vllm.mkdir(exist_ok=True)
    (hide_vllm / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    return {"PYTHONPATH": str(hide_vllm)}


def test_vllm_sampler_without_vllm_says_how_to_install(tmp_path):
    stderr = run_bad(tmp_path / "run", "sampler=vllm", env=hiding_vllm(tmp_path))
    assert "sampler=vllm needs vLLM" in stderr and "sampler=hf" in stderr and "pip install" in stderr
    assert "Traceback" not in stderr


def test_the_default_sampler_without_vllm_is_hf_said_once_and_saved(tmp_path):
    run_dir = tmp_path / "run"
    # hardware.compile_learner left at auto, the CPU default: one update settles it to eager
    done = run_cli(run_dir, *TINY, "trainer.steps=1", "logger=none", env=hiding_vllm(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr  # Hydra logs to stdout
    assert said.count("sampler=auto: vLLM is not installed here") == 1 and "or set sampler=vllm" in said
    assert "hardware.compile_learner=auto: learner updates 1 < 40, so the learner runs eager" in said
    saved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert saved["sampler"]["name"] == "hf"  # what ran, as the precision is saved
    assert saved["hardware"]["compile_learner"] is False  # settled, as the sampler
    assert saved["sampler"]["enforce_eager"] is True  # auto on the CPU
    assert saved["trainer"]["lr"] == DEFAULT_LR  # the lr an unset trainer.lr meant, saved (the default may move)
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row] == [1]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_sampler_dtype_vllm_refuses_names_the_key(tmp_path):
    # vLLM refuses float16 for Gemma 2 on any machine: a real refusal of the kind some CPUs give every model
    stderr = run_bad(tmp_path, "+model.random_init.model_type=gemma2", "+model.random_init.head_dim=64",
                     "hardware.attention=eager", "hardware.sampler_dtype=float16", "sampler=vllm")
    assert "hardware.sampler_dtype=float16" in stderr and "hardware.sampler_dtype=auto" in stderr, stderr[-3000:]
    assert "gemma2" in stderr and "Traceback" not in stderr


def test_interrupted_run_keeps_its_directory_and_metrics(tmp_path):
    command = [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={tmp_path}", *TINY, "sampler=hf",
               "trainer.steps=200", "logger=wandb", EAGER]
    # stderr to a file: a pipe nobody reads fills up with the progress bar and blocks the run
    stderr = open(tmp_path / "stderr.txt", "w")
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "WANDB_MODE": "offline"},
                               stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and any(r.get("step", 0) >= 2 for r in read_metrics(metrics)):
            break
        time.sleep(0.5)
    assert process.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
    process.send_signal(signal.SIGINT)  # what Ctrl-C (or a Slurm pre-emption warning) delivers
    # exits in seconds here; one CI-like run (a fresh clone, the suite taking 12 instead of 7 min) passed 120 s
    try:
        process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("the run did not stop within 300 s of SIGINT: " + (tmp_path / "stderr.txt").read_text()[-3000:])
    finally:
        stderr.close()
    assert process.returncode != 0
    rows = read_metrics(metrics)
    assert any("eval/pass@1" in r for r in rows) and any(r.get("step", 0) >= 2 for r in rows)
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert read_wandb_history(tmp_path), "the W&B file of the interrupted run holds no history"




def test_dapo_options_run_and_skip_steps_without_mixed_groups(tmp_path):
    # a random model earns no reward: dynamic sampling finds no mixed group, so every step is skipped
    # with a warning rather than training on zero advantages
    result = run_cli(tmp_path, *TINY, "sampler=hf", "algo=dapo", "algo.dynamic_sampling=true",
                     "algo.max_sampling_rounds=2", "algo.overlong_shaping=true", "algo.overlong_buffer=4",
                     "logger=none", EAGER)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dynamic sampling found no mixed one" in (tmp_path / "run.log").read_text()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if r.get("step", 0) > 0 and "perf/step_time_s" in r]
    assert len(steps) == 2 and all("train/loss" not in r for r in steps)


def test_the_loop_applies_the_focal_weight_to_each_group(tmp_path):
    # nothing patched: the same first batch (sampled before any update) under gamma = 0 and gamma = 1; each
    # mixed group's mean |advantage| shrinks by exactly its focal weight 1 - mu_hat (Eqs. 11-13); the step-size
    # control (advantage=mean_focal, gamma 1) shrinks every mixed group by their mean weight instead
    common = ["trainer.steps=1", "trainer.prompts_per_step=6", "algo.group_size=8", "eval.n_samples=1",
              "eval.max_problems=1", "sampler=hf", "hardware.compile_learner=false", "logger=none"]
    steps = {}
    for i, arm in enumerate(("focal.gamma=0", "focal.gamma=1", "advantage=mean_focal")):
        result = run_cli(tmp_path / f"arm{i}", *common, arm)  # no "=" in a run directory's name: Hydra would parse it
        assert result.returncode == 0, result.stderr[-3000:]
        steps[arm] = next(r for r in read_metrics(tmp_path / f"arm{i}" / "metrics.jsonl") if "train/loss" in r)
    rates = steps["focal.gamma=0"]["train/success_rate_hist"]
    assert rates == steps["focal.gamma=1"]["train/success_rate_hist"] == steps["advantage=mean_focal"]["train/success_rate_hist"]
    mixed = [i for i, rate in enumerate(rates) if 0 < rate < 1]
    assert mixed, f"no mixed group in the first batch (success rates {rates}): pick another seed"
    plain, focal, control = (steps[arm]["train/adv_abs_mean_per_group"]
                             for arm in ("focal.gamma=0", "focal.gamma=1", "advantage=mean_focal"))
    mean_weight = np.mean([1 - rates[i] for i in mixed])
    for i in mixed:
        assert focal[i] == pytest.approx(plain[i] * (1 - rates[i]), rel=1e-5), (i, rates[i])
        assert control[i] == pytest.approx(plain[i] * mean_weight, rel=1e-5), (i, rates[i])
    assert steps["focal.gamma=1"]["train/focal_weight_mean"] == pytest.approx(np.mean([1 - r for r in rates]), rel=1e-5)
    # the update's size is logged: the gradient norm, and the advantages' L2 norm, which the control scales as a whole
    assert all(steps[arm]["train/grad_norm"] > 0 and steps[arm]["train/adv_norm"] > 0 for arm in steps)
    assert steps["advantage=mean_focal"]["train/adv_norm"] == pytest.approx(
        steps["focal.gamma=0"]["train/adv_norm"] * mean_weight, rel=1e-5)


def test_the_loop_applies_the_chosen_advantage_method(tmp_path):
    # the same first batch as above under advantage=unlikeliness, which ranks each group's samples by the sampler's
    # own log-probs (Groups.mean_logprobs): the success rates are the focal run's, one-sided groups get 0, mixed ones not
    result = run_cli(tmp_path, "trainer.steps=1", "trainer.prompts_per_step=6", "algo.group_size=8", "eval.n_samples=1",
                     "eval.max_problems=1", "sampler=hf", "hardware.compile_learner=false", "logger=none",
                     "advantage=unlikeliness")
    assert result.returncode == 0, result.stderr[-3000:]
    step = next(r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r)
    rates = step["train/success_rate_hist"]
    assert any(0 < rate < 1 for rate in rates), f"no mixed group in the first batch (success rates {rates})"
    for rate, adv in zip(rates, step["train/adv_abs_mean_per_group"]):
        assert (adv > 0) == (0 < rate < 1), (rate, adv)
