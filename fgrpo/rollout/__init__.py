"""Rollouts: the problems (data.py: arithmetic, a user's generator, files, the hub; rows.py: a row's fields and prompt),
the samplers that draw completions (samplers.py: vLLM, HF generate) and the groups a step learns from, scored by the
reward functions of fgrpo.rewards (rollouts.py)."""
