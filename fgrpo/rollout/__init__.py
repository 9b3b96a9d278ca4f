"""Rollouts: the problems (data.py), the samplers that draw completions (samplers.py: vLLM, HF generate), the
verifier that scores them (verifier.py, answers.py) and the groups a step learns from (rollouts.py)."""
