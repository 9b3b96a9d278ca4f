"""The F-GRPO algorithm core: group-relative advantages with the focal weight (advantages.py) and the policy losses
of GRPO, DAPO and CISPO (losses.py). Pure tensor functions; imports nothing else of fgrpo."""
