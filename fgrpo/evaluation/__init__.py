"""Measurement: unbiased pass@k (pass_at_k.py), the held-out evaluation a run makes (held_out.py), pass@k plots
(plots.py), the rare-trajectory NLL set (rare_set.py), the per-problem counts of an evaluation (eval_counts.py) and
the tests that compare two of them (significance.py: paired, over seeds), a sweep's runs and its report
(sweep_runs.py, sweep_report.py), and the figures of the paper's theory (theory_figures.py)."""
