"""Infrastructure every layer may use, importing nothing above it: the bad-input errors (errors.py), process groups
(distributed.py), checkpoint files (checkpoint.py), the run directory's files (run_files.py), metrics.jsonl and its
W&B mirror (tracking.py, wandb_file.py), stop signals (stop.py), hub access (hub.py), the bf16 probe (precision.py)
and the process's memory (process_memory.py)."""
