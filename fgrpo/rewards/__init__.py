"""Rewards: the run's reward functions (``dataset.rewards``: fgrpo's checks by name, a user's by import path) and how
they run. entries.py checks the config's list; binding.py fills a function's parameters by name (fgrpo's, verl's and
TRL's conventions); calls.py is one call as a worker runs it (time limit, returned values), in the worker processes of
fgrpo.user_code; scoring.py the trainer's side (weighted sum, the one verdict, skips, faults); answers.py the built-in checks.
Everything but scoring.py imports without torch: the workers import only what a call needs."""
