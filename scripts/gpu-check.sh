#!/usr/bin/env bash
# Checks every GPU path of fgrpo on one CUDA GPU, offline, with the machine's own torch, in about 9 minutes, and
# writes a markdown report (GPU, versions, each check's result and time, the benchmark against TRL):
#   the tests marked gpu; run.py hardware=gpu with sampler=hf (and sampler=vllm where vLLM is installed); a run
#   killed with SIGKILL and run again, its final weights compared bitwise with an uninterrupted run's; torchrun
#   --nproc_per_node 1 with hardware.fsdp=true, and with hardware.cpu_offload=true; fgrpo.evaluate, fgrpo.compare
#   and fgrpo.rare_nll score on cuda; bench/compare_trl.py --hardware gpu (Qwen2.5-1.5B's shape, random weights,
#   16 prompts x 8 samples x 512 tokens), ours then TRL, alone on the card.
#
#   bash scripts/gpu-check.sh [OUT_DIR] [--budget 540] [--workload 16x8x512 ...] [--skip functional|bench]
#
# OUT_DIR defaults to outputs/gpu-check/<date-time>; the report is OUT_DIR/report.md, each check's log in
# OUT_DIR/logs/. Its reports go into bench/RESULTS.md. On a machine without network or the project's venv, first
# `bash ../shared/gpu-carry.sh` where the project is set up, and source .gpu-carry/env.sh on the GPU machine.
# FGRPO_PYTHON picks the interpreter (default: the repo's .venv if it has CUDA torch, else python3).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${FGRPO_PYTHON:-}
if [ -z "$python" ]; then
  python=python3
  if [ -x "$repo/.venv/bin/python" ] && "$repo/.venv/bin/python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    python=$repo/.venv/bin/python
  fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
exec "$python" "$repo/scripts/gpu_check.py" "$@"
