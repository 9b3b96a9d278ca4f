#!/usr/bin/env bash
# Checks fgrpo's GPU paths on one CUDA GPU, offline, with the machine's own torch, within a budget (default 420 s, so
# that two tries fit a 15-minute lease), and writes a markdown report. Checks run in order of priority, each with
# a time box; one that outlives it is killed and reported "out of time" (apart from FAILED, and from skipped:
# not started for want of time or of what it needs):
#   1. resume pairs, side by side: hardware.deterministic=true, and the defaults. Each runs run.py hardware=gpu
#      sampler=hf (tiny_random, 4 steps, a checkpoint each), then the same command killed with SIGKILL after step 2
#      and run again; the final weights bitwise (how many tensors differ, the largest difference) and the first
#      step whose loss or grad_norm differs between the two runs' metrics.jsonl;
#   2. alone on the card: bench/learner_step.py at Qwen2.5-1.5B's shape (random weights, 16x8x512; then steps of
#      drawn widths: torch.compile's graphs and recompiles; memory against fgrpo.learner.gpu_memory's estimate),
#      then TRL's learner on the same batch (bench/trl_learner_step.py); no sampling. The report's targets:
#      learner >= 35% of the card's bf16 matmul rate, >= 1.5x TRL's learner, state and activations within 15%;
#   3. as time allows, side by side: torchrun --nproc_per_node 1 with hardware.fsdp=true, and with
#      hardware.cpu_offload=true; pytest -m gpu; fgrpo.evaluate, fgrpo.compare, fgrpo.rare_nll score on cuda; a
#      LoRA run (model.lora.rank=16, where peft is installed: scripts/gpu-carry-lora.sh); then
#      alone: ours again with the layout sized from the card's memory (micro_batch_tokens=auto
#      keep_matmul_outputs_gib=auto), and sampler=vllm where vLLM is installed.
#
#   bash scripts/gpu-check.sh [OUT_DIR] [--budget 420] [--workload 16x8x512] [--skip functional|bench]
#
# OUT_DIR defaults to outputs/gpu-check/<date-time>; the report is OUT_DIR/report.md, each check's log in
# OUT_DIR/logs/, the benchmarks' numbers in OUT_DIR/bench/*.json. Exit 0: nothing failed and 1-2 ran; 1: a check
# failed; 2: a check of 1-2 ran out of time (those of 3 get what time is left; their state is in the report). Its reports go into bench/RESULTS.md. On a machine without network or the project's venv: first
# `bash ../shared/gpu-carry.sh && bash scripts/gpu-carry-lora.sh` where the project is set up, then on the GPU machine
# `. .gpu-carry/env.sh && bash scripts/gpu-check.sh`.
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
