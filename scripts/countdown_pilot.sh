#!/usr/bin/env bash
# The pilot of the Countdown confirmatory run (docs/countdown-pilot.md; exploratory, not in the confirmatory set):
# for each seed given, GRPO, F-GRPO (gamma 1) and the step-size control, one run after another, with
# conf/experiment/countdown_pilot.yaml. Each run checkpoints every 10 steps, so the same command after a kill resumes
# the run it cut (trainer.resume); a finished run (its summary.json written) is skipped, its checkpoints deleted
# (1.6 GB each). Each run records the CPU that ran it in cpu_kind.txt; a finished run's small files are copied to
# docs/results/countdown_pilot/runs/<arm>_seed<SEED>/ for committing.
#
#   bash scripts/countdown_pilot.sh 0 1 2                          # seeds 0, 1, 2: nine runs
#   PILOT_ARMS="grpo fgrpo" bash scripts/countdown_pilot.sh 1 2    # only these arms (the primary's pair first)
set -euo pipefail
(( $# )) || { echo "usage: bash scripts/countdown_pilot.sh SEED [SEED ...]" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
out=${COUNTDOWN_PILOT_DIR:-$repo/outputs/countdown_pilot}
rare=$repo/docs/results/countdown_pilot/rare_set
[[ -d $rare ]] || { echo "no $rare: build the rare-trajectory set first (docs/countdown-pilot.md)" >&2; exit 2; }
kind=$(grep -o 'avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ' || true)
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs || true): ${kind:-AVX2 only}"
keep_small_files() {  # $1: the run directory, $2: where its small files are committed
    rm -rf "$2" && mkdir -p "$2"
    cp -r "$1/.hydra" "$1/metrics.jsonl" "$1/eval_counts.jsonl" "$1/summary.json" "$1/cpu_kind.txt" "$2/"
}
arms=("grpo focal.gamma=0" "fgrpo focal.gamma=1" "control advantage=mean_focal focal.gamma=1")
wanted=${PILOT_ARMS:-grpo fgrpo control}
for w in $wanted; do
    [[ " grpo fgrpo control " == *" $w "* ]] || { echo "PILOT_ARMS: no arm '$w' (grpo, fgrpo, control)" >&2; exit 2; }
done
for seed in "$@"; do
    for arm in "${arms[@]}"; do
        name=${arm%% *}; overrides=${arm#* }
        [[ " $wanted " == *" $name "* ]] || continue
        run=$out/runs/${name}_seed$seed
        keep=$repo/docs/results/countdown_pilot/runs/${name}_seed$seed
        if [[ -f $run/summary.json ]]; then
            echo "seed $seed, $name: finished ($run), skipped" >&2; rm -rf "$run/checkpoints"
            [[ -f $keep/summary.json ]] || keep_small_files "$run" "$keep"  # killed before its copy
            continue
        fi
        echo "seed $seed, $name ($overrides): $run" >&2
        mkdir -p "$run" && echo "$cpu" >> "$run/cpu_kind.txt"
        (cd "$repo" && "$python" run.py experiment=countdown_pilot $overrides "seed=$seed" logger=none \
            "eval.rare_set=$rare" trainer.checkpoint_every=10 trainer.keep_checkpoints=1 "hydra.run.dir=$run")
        rm -rf "$run/checkpoints"
        keep_small_files "$run" "$keep"
    done
done
