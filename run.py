"""fgrpo's entry point: `python run.py [group=option ...] [key=value ...]`.

Examples:
    python run.py                                  # GRPO on one-digit arithmetic, SmolLM2-135M, CPU
    python run.py algo=cispo focal.gamma=1.0       # F-CISPO
    python run.py -m algo=grpo,dapo,cispo focal.gamma=0,0.5,1 seed=0,1   # a sweep
See README.md for every key.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

# quiet third-party chatter so the progress bar stays readable; users can override
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from fgrpo.config import register_configs

from fgrpo.infra.errors import BAD_INPUT

register_configs()
log = logging.getLogger("fgrpo")


def pin_run_dir_for_all_ranks(argv: list[str]) -> None:
    """Under torchrun every rank runs this script and would resolve hydra.run.dir's ``${now:...}`` on its own clock,
    maybe a second apart: rank 0's time goes to all, as ``hydra.run.dir=outputs/<date>/<time>`` (the default's
    pattern). Not when the command pins the directory itself, nor for one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or "RANK" not in os.environ:
        return
    if any(arg in ("-m", "--multirun") or arg.startswith("hydra.run.dir=") for arg in argv):
        return
    from fgrpo.infra import distributed

    distributed.init_from_env()
    argv.append(f"hydra.run.dir=outputs/{distributed.from_rank0(time.strftime('%Y-%m-%d/%H-%M-%S'))}")


def quiet_other_ranks(rank: int) -> None:
    """Rank 0 alone writes the run's log file and its info messages; the others say only what goes wrong."""
    if rank == 0:
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
    log.setLevel(logging.WARNING)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from fgrpo.infra import distributed
    from fgrpo.train import train

    ranks = distributed.init_from_env()  # under Slurm: each task's rank from Slurm's variables
    quiet_other_ranks(ranks.rank)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    run_name = hydra_cfg.job.override_dirname or "default"
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if sweeping and cfg.logger.get("group") is None:
        # one W&B group per sweep, named after its directory
        sweep_dir = Path(hydra_cfg.sweep.dir)
        with open_dict(cfg):
            cfg.logger.group = f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}"
    # Hydra saved the job's config before this: train() records there what it settles (the W&B group above,
    # the precision that hardware.*_dtype=auto chose on this machine)
    saved = run_dir / hydra_cfg.output_subdir / "config.yaml" if hydra_cfg.output_subdir else None
    log.info("run directory: %s%s", run_dir, f" (W&B group {cfg.logger.group})" if sweeping else "")
    try:
        final = train(cfg, run_dir, run_name=run_name, overrides=list(hydra_cfg.overrides.task), saved_config=saved)
    except BAD_INPUT as error:
        if ranks.main:
            log.error("%s", error)
        if sweeping:  # this job fails alone; the sweep goes on and reports it at the end
            raise
        # bad input: a clear message (once, from rank 0), no traceback, every rank exits non-zero
        if ranks.main:
            print(f"error: {error}", file=sys.stderr)
        distributed.close()
        sys.exit(2)
    log.info("final: %s", {k: round(v, 4) for k, v in final.items() if "/" in k and k.count("/") == 1})
    return final.get("eval/pass@1")


if __name__ == "__main__":
    pin_run_dir_for_all_ranks(sys.argv)
    main()
