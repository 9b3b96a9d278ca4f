"""fgrpo: an experiment runner for F-GRPO (arXiv 2602.06717) and its GRPO / DAPO / CISPO baselines.

The package in layers (docs/architecture.md): algorithm/ and infra/ at the bottom; rewards/ (a run's reward functions,
a user's by import path: docs/tasks.md), learner/, rollout/ and evaluation/ above them; config.py, validation.py,
prepare.py (the setup every entry point shares), checkpointing.py, step_metrics.py and the loop in train.py; the
command-line tools python -m fgrpo.evaluate | compare | rare_nll | report | export | theory on top.

The algorithm core is importable without the runner's dependencies:

    from fgrpo.algorithm.advantages import group_advantages, success_rate, focal_weight, focal_group_advantages
    from fgrpo.algorithm.losses import policy_loss, aggregate
    from fgrpo.evaluation.pass_at_k import pass_at_k, pass_at_k_curve
    from fgrpo.algorithm.lemma import miss_probability, simulate_miss_probability
"""

__version__ = "0.1.0"
