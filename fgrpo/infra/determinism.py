"""``hardware.deterministic=true``: the same inputs give the same bits, run after run, so that a run killed and resumed
ends with the weights of the run that was never stopped.

What varies between two runs of the same step without it, on a GPU: cuBLAS picks its split-K workspace per stream
(``CUBLAS_WORKSPACE_CONFIG`` fixes it), a few kernels add with atomics (torch's deterministic algorithms replace them
or refuse), cuDNN benchmarks its algorithms, and inductor times candidate kernels of a reduction at their first call
and keeps the fastest (its ``deterministic`` mode skips every such timing that changes numerics). On the CPU the
default path is bitwise repeatable (tests/test_resume.py; the compiled segment attention's backward since it sums a
shared prompt's key gradients in a fixed order, tests/learner/test_segment_attention.py); the flags cost there too
and change nothing.

vLLM's sampling is not bitwise repeatable across a resume: on a GPU it has no deterministic mode, and on the CPU
its engine's generator is not saved (two default runs from the start drew the same bits, bench/RESULTS.md), so
``sampler=vllm`` with this key is refused: the learner would be, the samples it learns from would not.
"""

from __future__ import annotations

import contextlib
import os
import re

import torch

from fgrpo.infra.errors import ConfigError

# settings with no deterministic path: (config key, its value that has none, why, what to do)
NONDETERMINISTIC_SETTINGS = (
    ("sampler.name", "vllm", "vLLM's sampling is not bitwise repeatable across a resume (no deterministic mode on a "
     "GPU; on the CPU its generator is not saved)",
     "use sampler=hf (transformers generate through the learner's weights), or hardware.deterministic=false"),
)
# cuBLAS's fixed workspace for repeatable results (CUDA's documentation; the other allowed value is ":16:8")
CUBLAS_WORKSPACE = ":4096:8"


def check_deterministic_settings(cfg) -> None:
    """``hardware.deterministic=true`` beside a setting in :data:`NONDETERMINISTIC_SETTINGS`: a ConfigError naming
    both keys, before the model loads."""
    if not cfg.hardware.get("deterministic", False):
        return
    for key, value, why, fix in NONDETERMINISTIC_SETTINGS:
        node, _, leaf = key.rpartition(".")
        if cfg[node][leaf] == value:
            raise ConfigError(f"hardware.deterministic=true with {node}={value}: {why}. Either {fix}")


def make_deterministic() -> None:
    """Deterministic kernels for the rest of the process: call before the first CUDA matmul (cuBLAS reads its
    workspace setting when it starts) and before anything compiles."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"  # inductor's compile workers read the environment
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    import torch._inductor.config as inductor

    inductor.max_autotune = inductor.coordinate_descent_tuning = False
    if hasattr(inductor, "deterministic"):  # torch >= 2.9: no on-device timing that changes numerics
        inductor.deterministic = True


# torch's message for an op without a deterministic kernel under use_deterministic_algorithms(True)
_NO_DETERMINISTIC_KERNEL = re.compile(r"(\S+) does not have a deterministic implementation")


class NondeterministicOp(ConfigError):
    """An op with no deterministic kernel ran under ``hardware.deterministic=true``: the setting's error, printed
    without a traceback by every entry point (fgrpo.infra.errors.BAD_INPUT)."""


@contextlib.contextmanager
def naming_nondeterministic_ops():
    """Re-raise torch's refusal of an op without a deterministic kernel as :class:`NondeterministicOp`, naming the op
    and the key that asked for determinism (torch's own message names neither the setting nor a way out)."""
    try:
        yield
    except RuntimeError as error:
        found = _NO_DETERMINISTIC_KERNEL.search(str(error))
        if found is None or isinstance(error, NondeterministicOp):
            raise
        raise NondeterministicOp(
            f"hardware.deterministic=true: {found.group(1)} has no deterministic kernel on this device, and this run "
            f"reached it. Set hardware.deterministic=false (the run is then not bitwise repeatable, docs/gpu.md), or "
            f"change the setting that brings the op in. torch said: {str(error).splitlines()[0]}") from error
