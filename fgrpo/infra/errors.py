"""The errors that mean bad input: their message names the problem and the fix, so every entry point (run.py, the
sweeper, fgrpo.evaluate, fgrpo.rare_nll, fgrpo.compare, fgrpo.report, fgrpo.export) prints it alone, without a
traceback, and exits with status 2. Raised before expensive work starts wherever the input allows."""


class ConfigError(ValueError):
    """A config value out of its allowed range; the message names the key, the value and the fix."""


class DataError(ValueError):
    """Bad dataset input (path, fields, rows, hub access)."""


class ModelSourceError(ValueError):
    """The configured model cannot be found or loaded; the message says what to pass instead."""


class SamplerUnavailable(RuntimeError):
    """The configured sampler cannot run here; the message says how to install it or switch."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none of those on disk can be read."""


class CompareError(ValueError):
    """Two evaluations cannot be compared, or one cannot be read; the message says why and what to do."""


class RewardError(RuntimeError):
    """A user's reward function failed on every sample of its first batch (the message carries its traceback): a bug
    to fix before a run can learn anything, not a fault to count."""


class AdvantageError(ValueError):
    """An advantage method returned something the loss cannot use (its shape, dtype or a NaN): its own fault, named,
    rather than a non-finite gradient blamed on the learning rate."""


# the one list every entry point catches (and the sweeper shows without a traceback)
BAD_INPUT = (ConfigError, DataError, ModelSourceError, SamplerUnavailable, CheckpointError, CompareError, RewardError,
             AdvantageError)
