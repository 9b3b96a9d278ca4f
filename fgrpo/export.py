"""A run's checkpoint as a Hugging Face folder (config, safetensors, tokenizer), for vLLM, lm-eval or the Hub:

    python -m fgrpo.export RUN_DIR                 # the latest checkpoint, into RUN_DIR/export/step_N
    python -m fgrpo.export RUN_DIR --step 40 --out /models/fgrpo-step40

Works on a checkpoint saved by any number of ranks, in one process on the CPU (the weights load whole). The model
is rebuilt from the checkpoint's own config (its model source must still be reachable: the bundled model, a
folder, or a hub id on a machine with a network).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from fgrpo.infra import checkpoint
from fgrpo.infra.errors import CheckpointError

log = logging.getLogger("fgrpo")


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """Checkpoint ``step`` of ``run_dir``, or its latest; raises CheckpointError naming what exists."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a directory: pass a run directory (outputs/DATE/TIME)")
    complete = checkpoint.complete_checkpoints(run_dir)
    steps = ", ".join(str(checkpoint.read_step(p)) for p in complete) or "none"
    if step is None:
        candidates = checkpoint.resume_candidates(run_dir)
        if not candidates:
            raise CheckpointError(
                f"{run_dir} has no checkpoint (trainer.checkpoint_every, trainer.checkpoint_every_min make them)")
        return candidates[0]
    path = checkpoint.checkpoints_dir(run_dir) / checkpoint.step_name(step)
    if path not in complete:
        raise CheckpointError(f"{run_dir} has no complete checkpoint of step {step}; it has steps: {steps}")
    return path


def export(run_dir: Path, *, step: int | None = None, out: Path | None = None) -> Path:
    """Write checkpoint ``step`` (default: the latest) of ``run_dir`` as an HF folder; returns the folder."""
    from omegaconf import OmegaConf

    from fgrpo.learner.model import load_policy, load_tokenizer, resolve_model_folder

    path = find_checkpoint(run_dir, step)
    state = checkpoint.read_trainer_state(path)
    model_cfg = OmegaConf.create(state.config["model"])
    folder = resolve_model_folder(model_cfg)
    policy = load_policy(folder, dtype=state.config["hardware"]["learner_dtype"], device="cpu", attention="sdpa")
    checkpoint.load_checkpoint(path, policy)
    out = Path(out) if out is not None else Path(run_dir) / "export" / checkpoint.step_name(state.step)
    policy.save_pretrained(out)
    load_tokenizer(folder).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fgrpo.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (it holds checkpoints/)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--out", type=Path, default=None, help="the folder to write (default: RUN_DIR/export/step_N)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = export(args.run_dir, step=args.step, out=args.out)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
