"""hardware.deterministic (fgrpo/infra/determinism.py): the settings refused beside it, the flags it sets, torch's
refusal of an op renamed to the key, and a deterministic run killed and resumed (tests/test_resume.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fgrpo.infra.determinism import NondeterministicOp, check_deterministic_settings, naming_nondeterministic_ops
from fgrpo.infra.errors import BAD_INPUT, ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_deterministic_with_the_vllm_sampler_is_refused_naming_both_keys(compose):
    check_deterministic_settings(compose("hardware.deterministic=true", "sampler=hf"))
    check_deterministic_settings(compose("sampler=vllm"))  # the default: not deterministic, nothing to refuse
    with pytest.raises(ConfigError, match=r"hardware.deterministic=true with sampler=vllm: vLLM's sampling is not "
                                          r"bitwise repeatable.*use sampler=hf"):
        check_deterministic_settings(compose("hardware.deterministic=true", "sampler=vllm"))


def test_the_refusal_comes_from_the_checks_before_the_model_loads(compose):
    from fgrpo.prepare import check_inputs

    with pytest.raises(ConfigError, match="hardware.deterministic=true with sampler=vllm"):
        check_inputs(compose("model=tiny_random", "hardware.deterministic=true", "sampler=vllm"))


# in a fresh process: the flags are process-wide and would change every later test's kernels
FLAGS_SCRIPT = """
import os, torch
from fgrpo.infra.determinism import make_deterministic
import torch._inductor.config as inductor
make_deterministic()
print(os.environ["CUBLAS_WORKSPACE_CONFIG"], torch.are_deterministic_algorithms_enabled(),
      torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, inductor.deterministic,
      inductor.max_autotune, inductor.coordinate_descent_tuning, os.environ["TORCHINDUCTOR_DETERMINISTIC"])
"""


def test_make_deterministic_sets_torch_cublas_cudnn_and_inductor_flags():
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    done = subprocess.run([sys.executable, "-c", FLAGS_SCRIPT], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [":4096:8", "True", "True", "False", "True", "False", "False", "1"]


def test_an_op_without_a_deterministic_kernel_is_named_with_the_key():
    # torch raises this only for CUDA kernels (every CPU op has a deterministic one): its message, as torch words it
    message = ("scatter_add_cuda_kernel does not have a deterministic implementation, but you set "
               "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation...")
    with pytest.raises(NondeterministicOp, match=r"hardware.deterministic=true: scatter_add_cuda_kernel has no "
                                                 r"deterministic kernel.*hardware.deterministic=false"):
        with naming_nondeterministic_ops():
            raise RuntimeError(message)
    assert issubclass(NondeterministicOp, BAD_INPUT)  # printed as one line, exit status 2
    with pytest.raises(RuntimeError, match="^something else$"):  # other errors pass as they are
        with naming_nondeterministic_ops():
            raise RuntimeError("something else")
    with naming_nondeterministic_ops():  # and nothing happens without an error
        torch.zeros(1)
