"""Two training steps on ``tiny_random`` through ``python run.py``, reduced to a fingerprint of the update.

The refactor of issue 22 must not change what an update does. ``tests/data/two_steps.json`` holds the
fingerprints recorded from main before it (``python tests/children/two_steps.py`` rewrites them); test_run compares a fresh
run with them. Precision is pinned to fp32 and the sampler to HF so that the numbers do not depend on the CPU kind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).resolve().parents[1] / "data" / "two_steps.json"
COMMON = [
    "model=tiny_random", "trainer.steps=2", "trainer.prompts_per_step=2", "algo.group_size=4", "eval.n_samples=2",
    "eval.max_problems=2", "eval.every=0", "sampler.max_new_tokens=8", "sampler=hf", "logger=none",
    "hardware.autocast_dtype=null", "hardware.sampler_dtype=float32", "trainer.lr=1e-3", "trainer.warmup_steps=1",
    "trainer.save_final=true", "algo.entropy_coef=0.01",
]
# a random model earns no reward: the entropy bonus (and the KL term) give every parameter a gradient
CASES = {
    "cispo_compiled": ["algo=cispo", "focal.gamma=1.0"],
    "grpo_eager_minibatches_kl": ["algo=grpo", "trainer.mini_batches=2", "algo.kl_coef=0.05",
                                  "hardware.compile_learner=false", "hardware.gradient_checkpointing=false",
                                  "hardware.attention=sdpa"],
}
METRICS = ["train/loss", "train/grad_norm", "train/entropy", "train/approx_kl", "train/kl_ref",
           "train/completion_len_mean", "perf/learner_computed_tokens"]


def fingerprint(case: str, run_dir: Path) -> dict:
    """Run ``case`` into ``run_dir``; per parameter the change's sum, norm and first values, and the step metrics."""
    from safetensors.torch import load_file

    from fgrpo.learner.model import random_folder

    command = [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={run_dir}", *COMMON, *CASES[case]]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "WANDB_MODE": "offline"})
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=1024)  # conf/model/tiny_random.yaml
    before = load_file(str(random_folder(shape, seed=0) / "model.safetensors"))
    after = load_file(str(run_dir / "final_model" / "model.safetensors"))
    weights = {}
    for name in sorted(before):
        delta = (after[name].double() - before[name].double()).flatten()
        weights[name] = {"sum": delta.sum().item(), "norm": delta.norm().item(), "first": delta[:4].tolist()}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    return {"weights": weights, "steps": [{key: row.get(key) for key in METRICS} for row in steps]}


if __name__ == "__main__":
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            out[case] = fingerprint(case, Path(tmp) / case)
    RECORDED.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RECORDED}")
