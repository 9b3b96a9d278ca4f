#!/usr/bin/env bash
# Adds peft's wheel (pure Python; model.lora needs it) to .gpu-carry/whl, which ../shared/gpu-carry.sh makes and
# whose env.sh installs every wheel there on the GPU machine. Run it here after that script:
#   bash ../shared/gpu-carry.sh && bash scripts/gpu-carry-lora.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ -d "$root/.gpu-carry/whl" ] || { echo "no .gpu-carry/whl: run bash ../shared/gpu-carry.sh first" >&2; exit 1; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
  -d "$root/.gpu-carry/whl" "peft==0.21.2"
ls "$root/.gpu-carry/whl" | grep -i peft
