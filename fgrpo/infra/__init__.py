"""Infrastructure every layer may use: the bad-input errors (errors.py), process groups (distributed.py),
checkpoints, stop signals, run-directory files and tracking (W&B, metrics.jsonl), hub access, precision and memory."""
