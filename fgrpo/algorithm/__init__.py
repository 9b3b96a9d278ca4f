"""The F-GRPO algorithm core, pure tensor and array functions that import nothing else of fgrpo: group-relative
advantages with the focal weight (advantages.py, the paper's Eqs. 3, 11-13), the policy losses of GRPO, DAPO and
CISPO (losses.py, Eqs. 14-16), and the paper's theory: Lemma 3.1's miss probability (lemma.py) and the categorical
simulation of section 5.1 (categorical.py)."""
