"""The sampler/learner mismatch in real runs (`python run.py`, the real vLLM): a sampler in bf16 against a learner in
fp32 logs a larger mismatch than both in fp32, and a masked correction masks some tokens there and none in fp32."""

import pytest

from fgrpo.infra.run_files import read_metrics
from test_run import EAGER, TINY, run_cli

# a long completion budget, the learner in fp32; bounds tight enough that a bf16 sampler's rounding crosses them and
# an fp32 one's does not: on tiny_random (near-uniform draws) |log ratio| reached 5e-3 with bf16 (mean 1.1e-3) and
# 1.9e-6 with fp32 (2-core AMD EPYC, AVX2)
MEASURED = [*TINY, "trainer.steps=1", "eval.before=false", "sampler=vllm", "sampler.max_new_tokens=48",
            "hardware.autocast_dtype=float32", "algo.rollout_correction=token_mask", "algo.correction_low=0.999",
            "algo.correction_high=1.001", "logger=none", EAGER]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_bf16_sampler_against_an_fp32_learner_shows_the_mismatch_and_the_mask_drops_tokens(tmp_path):
    steps = {}
    for name, dtype, temperature in [("float32", "float32", 1.0), ("bfloat16", "bfloat16", 1.0),
                                     ("float32 at 0.6", "float32", 0.6)]:
        run_dir = tmp_path / name.replace(" ", "_")
        done = run_cli(run_dir, *MEASURED, f"hardware.sampler_dtype={dtype}", f"sampler.temperature={temperature}")
        assert done.returncode == 0, done.stderr[-3000:]
        steps[name] = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row][0]
    fp32, bf16 = steps["float32"], steps["bfloat16"]
    # vLLM's log-probs are those of the distribution it drew from, after the temperature, as the learner's are
    assert steps["float32 at 0.6"]["train/mismatch/log_ratio_abs_max"] < 1e-4
    assert bf16["train/mismatch/kl_token"] > 10 * fp32["train/mismatch/kl_token"]
    assert bf16["train/mismatch/log_ratio_abs_max"] > 1e-3 > fp32["train/mismatch/log_ratio_abs_max"]
    assert bf16["train/mismatch/dropped_frac"] > 0 and fp32["train/mismatch/dropped_frac"] == 0
    assert bf16["train/mismatch/tokens_out_frac"] == pytest.approx(bf16["train/mismatch/dropped_frac"])


@pytest.mark.parametrize("options", [
    # GSPO with the focal weight (F-GSPO), the sampler's log-probs as the old policy of two mini-batches
    ["algo=gspo", "focal.gamma=1.0", "trainer.mini_batches=2", "algo.old_logprobs=sampler"],
    # every other option at once: a sequence mask, DeepSeek-V3.2's off-policy mask, the bias-corrected KL, CISPO's
    # sequence form over two mini-batches with the learner's old log-probs
    ["algo=cispo", "algo.ratio_level=sequence", "trainer.mini_batches=2", "algo.rollout_correction=sequence_mask",
     "algo.off_policy_mask=0.5", "algo.kl_coef=0.01", "algo.kl_bias_correction=true"],
], ids=["f-gspo-sampler-old", "cispo-sequence-masks-kl"])
def test_the_options_train_through_the_learner_and_log_the_mismatch(tmp_path, options):
    done = run_cli(tmp_path, *TINY, "sampler=hf", "logger=none", EAGER, *options)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [row for row in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in row]
    assert len(steps) == 2 and all(0 <= row["train/mismatch/kl_token"] < 1e-3 for row in steps)
    # the options reached the loss: a correction reports what it dropped, a KL term its value (tiny_random answers
    # nothing right, so the advantages, and at the first step the KL's gradient, are 0: no gradient to assert on)
    assert all(("train/mismatch/dropped_frac" in row) == ("algo.rollout_correction=sequence_mask" in options)
               and ("train/kl_ref" in row) == ("algo.kl_coef=0.01" in options) for row in steps)
