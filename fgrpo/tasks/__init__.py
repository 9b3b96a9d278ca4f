"""Tasks that come with fgrpo beside its own arithmetic: other libraries' problem generators, each with its reward
function, named in a config like a user's task (reasoning_gym.py: reasoning-gym's tasks by name). A module here may
import fgrpo.rollout and fgrpo.rewards' pure parts, never the trainer."""
