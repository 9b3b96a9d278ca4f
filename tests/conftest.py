import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# tests/helpers (shared test code) and tests/children (scripts the tests start as processes, whose constants the
# tests read too) import by name from every test folder
sys.path[:0] = [str(Path(__file__).resolve().parent / "helpers"), str(Path(__file__).resolve().parent / "children")]

# W&B never reaches a server from the tests; vLLM runs in-process and quietly
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def compose():
    """Compose the real conf/ tree with overrides, as `python run.py` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fgrpo.config import register_configs

    register_configs()

    def _compose(*overrides: str, hydra: bool = False):
        """``hydra``: with the ``hydra`` node too (the launcher's settings)."""
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides), return_hydra_config=hydra)

    return _compose


@pytest.fixture(scope="module")
def tiny_model():
    """A 2-layer Llama with a 97-token vocabulary, random weights, fp32 (tests deep-copy it before changing it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).float()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` skip, saying why, in a venv without vLLM (scripts/setup.sh installs the rest where vLLM
    has no build, e.g. macOS); everything else runs there with sampler=hf."""
    from fgrpo.rollout.samplers import vllm_available

    if vllm_available():
        return
    skip = pytest.mark.skip(reason="needs vLLM, which is not installed in this venv (no build for this platform, or "
                                   "scripts/setup.sh could not install it): the sampler=hf tests cover the rest")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


def slurm_problem() -> str | None:
    """Why the tests marked ``slurm`` cannot run here, or None when a local cluster is up."""
    if shutil.which("sbatch") is None or shutil.which("sacct") is None:
        return "no Slurm client (sbatch/sacct) on PATH: install it and run scripts/local-slurm start"
    try:
        status = subprocess.run([str(REPO / "scripts" / "local-slurm"), "status"], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"scripts/local-slurm status failed: {error}"
    if status.returncode != 0:
        return f"no local Slurm cluster is up (run scripts/local-slurm start): {status.stdout.strip()}"
    return None


@pytest.fixture
def slurm():
    """Skips the test, saying why, where no Slurm cluster is up (scripts/local-slurm start); fails it under CI=true."""
    from ci_strict import skip_unless_ci

    problem = slurm_problem()
    if problem:
        skip_unless_ci(problem)
