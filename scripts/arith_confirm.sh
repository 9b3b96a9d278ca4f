#!/usr/bin/env bash
# One seed of the pre-registered confirmatory run (docs/results.md, "Pre-registration"): its three arms one after
# another, in the order rotated per seed, each from the pre-registration's own commit of fgrpo/ and conf/ (a git
# worktree of that commit), each run's small files copied to docs/results/arith_confirm/runs/<arm>_seed<SEED>/ for
# committing. A run cut short starts again from the beginning (its directory is replaced): no resume. An arm whose
# files are already there is skipped, so a seed stopped between arms goes on with the next one.
#
#   bash scripts/arith_confirm.sh 3          # seed 3: GRPO, F-GRPO, the step-size control
#   bash scripts/arith_confirm.sh 4          # seed 4: F-GRPO, the control, GRPO
set -euo pipefail
seed=${1:?usage: bash scripts/arith_confirm.sh SEED (3 to 18, docs/results.md)}
if ! [[ $seed =~ ^[0-9]+$ ]] || (( seed < 3 || seed > 18 )); then
    echo "seed $seed: the pre-registration fixes seeds 3 to 18" >&2; exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
prereg=$(git -C "$repo" log --diff-filter=A --format=%H -- conf/experiment/arith_confirm.yaml | tail -1)
[[ -n $prereg ]] || { echo "conf/experiment/arith_confirm.yaml is not committed: commit the pre-registration first" >&2; exit 2; }
[[ -d $repo/docs/results/arith_confirm/rare_set ]] || {
    echo "no docs/results/arith_confirm/rare_set: build it once, before the first run (docs/results.md)" >&2; exit 2; }
tree=${ARITH_CONFIRM_TREE:-$repo/outputs/arith_confirm/tree-${prereg:0:12}}
[[ -d $tree ]] || git -C "$repo" worktree add --detach "$tree" "$prereg"
# the CPU kind that runs this seed: the pre-registration runs a seed's three arms on one kind
kind=$(grep -o 'avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ' || true)
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs): ${kind:-AVX2 only}"
for done_file in "$repo"/docs/results/arith_confirm/runs/*_seed"$seed"/cpu_kind.txt; do
    [[ -f $done_file ]] || continue
    if [[ $(cut -d: -f2- "$done_file" | xargs) != $(echo "${cpu#*:}" | xargs) ]]; then
        echo "seed $seed: $(basename "$(dirname "$done_file")") ran on '$(cat "$done_file")', this machine is '$cpu';" \
            "the pre-registration runs a seed's three arms on one CPU kind: run this seed on that kind, or another seed here" >&2
        exit 3
    fi
done
arms=("grpo focal.gamma=0" "fgrpo focal.gamma=1" "control advantage=mean_focal")
for i in 0 1 2; do
    arm=${arms[$(( (seed - 3 + i) % 3 ))]}
    name=${arm%% *}; override=${arm#* }
    run=$repo/outputs/arith_confirm/${name}_seed$seed
    keep=$repo/docs/results/arith_confirm/runs/${name}_seed$seed
    if [[ -f $keep/cpu_kind.txt ]]; then  # the last file written after a run ends: this arm is done
        echo "seed $seed, $name: finished before ($keep), skipped" >&2; continue
    fi
    rm -rf "$run"
    echo "seed $seed, $name ($override), from ${prereg:0:12}: $run" >&2
    (cd "$tree" && "$python" run.py experiment=arith_confirm "$override" "seed=$seed" \
        "eval.rare_set=$repo/docs/results/arith_confirm/rare_set" "hydra.run.dir=$run")
    rm -rf "$keep" && mkdir -p "$keep"
    cp -r "$run/.hydra" "$run/metrics.jsonl" "$run/eval_counts.jsonl" "$run/summary.json" "$keep/"
    echo "$cpu" > "$keep/cpu_kind.txt"  # the CPU kind that ran it (docs/results.md names it per run)
done
