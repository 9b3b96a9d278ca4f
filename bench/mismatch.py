"""How far the sampler's log-probs are from the learner's (fgrpo.algorithm.corrections), per setting, and what each
rollout correction does to a short run: real `python run.py` runs of the bundled model on the default experiment.

    python bench/mismatch.py settings --steps 3          # item 1: the mismatch of each setting, no correction
    python bench/mismatch.py settings --only fp32,sampler-bf16
    python bench/mismatch.py modes                       # item 2: each rollout correction on the default run
    python bench/mismatch.py modes --extra hardware.sampler_dtype=bfloat16

`settings` prints, per setting, the step-mean of train/mismatch/kl_token, kl_seq, log_ratio_abs_mean, the largest
log_ratio_abs_max and the step-mean of tokens_out_frac and seqs_out_frac (bounds [0.5, 2]), and the run's seconds.
`modes` prints, per mode, pass@1 and pass@8 on the held-out set after the run, the step-mean of
train/mismatch/dropped_frac and the run's seconds. Each run alone on the machine; the CPU kind is printed first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fgrpo.infra.precision import cpu_kind, cpu_name  # noqa: E402

# each setting's overrides over the default run (the learner eager unless said; auto dtypes unless said)
SETTINGS = {
    "fp32": ["hardware.autocast_dtype=null", "hardware.sampler_dtype=float32"],
    "sampler-bf16": ["hardware.autocast_dtype=null", "hardware.sampler_dtype=bfloat16"],
    "bf16-both": ["hardware.autocast_dtype=bfloat16", "hardware.sampler_dtype=bfloat16"],
    "hf-sampler": ["sampler=hf", "hardware.autocast_dtype=null", "hardware.sampler_dtype=float32"],
    "compiled": ["hardware.compile_learner=true", "hardware.autocast_dtype=null", "hardware.sampler_dtype=float32"],
    "lora": ["model.lora.rank=16", "hardware.autocast_dtype=null", "hardware.sampler_dtype=float32"],
}
MODES = ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
MISMATCH = ["kl_token", "kl_seq", "log_ratio_abs_mean", "log_ratio_abs_max", "tokens_out_frac", "seqs_out_frac"]


def run(run_dir: Path, overrides: list[str]) -> tuple[list[dict], float]:
    """One run of run.py; its metrics.jsonl rows and its seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "run.py"), f"hydra.run.dir={run_dir}", "logger=none",
                           *overrides], cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"run.py {' '.join(overrides)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, seconds


def step_values(rows: list[dict], key: str) -> list[float]:
    return [row[key] for row in rows if key in row]


def settings(args, root: Path) -> None:
    names = args.only.split(",") if args.only else list(SETTINGS)
    print(f"{'setting':14s} " + " ".join(f"{key:>18s}" for key in MISMATCH) + f" {'seconds':>8s}")
    for name in names:
        rows, seconds = run(root / name, [*SETTINGS[name], f"trainer.steps={args.steps}", "eval.before=false",
                                          "eval.max_problems=1", "eval.n_samples=1", *args.extra])
        values = []
        for key in MISMATCH:
            series = step_values(rows, f"train/mismatch/{key}")
            values.append(max(series) if key.endswith("_max") else statistics.mean(series))
        print(f"{name:14s} " + " ".join(f"{value:18.3e}" for value in values) + f" {seconds:8.0f}", flush=True)


def modes(args, root: Path) -> None:
    print(f"{'mode':18s} {'pass@1':>8s} {'pass@8':>8s} {'dropped_frac':>13s} {'kl_token':>10s} {'seconds':>8s}")
    for mode in args.only.split(",") if args.only else MODES:
        rows, seconds = run(root / mode, [f"algo.rollout_correction={mode}", *args.extra])
        final = [row for row in rows if "eval/arithmetic/pass@1" in row][-1]
        dropped = step_values(rows, "train/mismatch/dropped_frac")
        print(f"{mode:18s} {final['eval/arithmetic/pass@1']:8.3f} {final['eval/arithmetic/pass@8']:8.3f} "
              f"{statistics.mean(dropped) if dropped else 0.0:13.2e} "
              f"{statistics.mean(step_values(rows, 'train/mismatch/kl_token')):10.2e} {seconds:8.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["settings", "modes"])
    parser.add_argument("--steps", type=int, default=3, help="settings: steps per run")
    parser.add_argument("--only", default="", help="comma-separated settings or modes")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run")
    parser.add_argument("--keep", type=Path, help="a folder to keep the run directories in")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()} ({cpu_kind()})", flush=True)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        (settings if args.what == "settings" else modes)(args, args.keep)
        return
    with tempfile.TemporaryDirectory() as root:
        (settings if args.what == "settings" else modes)(args, Path(root))


if __name__ == "__main__":
    main()
