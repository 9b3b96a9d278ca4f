"""F-GRPO inside other trainers, from fgrpo's own focal weight (fgrpo.algorithm.advantages.focal_weight):
:mod:`fgrpo.integrations.trl` (a TRL ``GRPOTrainer`` subclass) and :mod:`fgrpo.integrations.verl` (a verl advantage
estimator). Neither is imported here: each needs its own stack installed (docs/integrations.md)."""
