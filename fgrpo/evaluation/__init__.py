"""Measurement: unbiased pass@k (pass_at_k.py), the held-out evaluation a run makes (held_out.py), pass@k plots
(plots.py), the rare-trajectory NLL set (rare_set.py) and the paired statistics of fgrpo.compare and fgrpo.report."""
