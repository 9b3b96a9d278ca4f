"""User code: what fgrpo runs of the user's, by import path, in worker processes that cannot hurt the run. One kind of
thing whatever the code is (reward functions, task generators, environments): loading.py finds it by its path;
pool.py runs requests in worker processes (pebble: a time limit per task, a dead or stuck worker replaced);
worker.py is what a worker does to itself at start (signals, seed, memory cap); time_limit.py bounds one call;
running.py is how a worker runs any request (the event loop, the seeding, the user's traceback). The rewards
(fgrpo.rewards) and the environments (fgrpo.environments) build their requests on it; it imports neither."""
