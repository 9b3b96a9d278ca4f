"""A run's checkpoint as a Hugging Face folder (config, safetensors, tokenizer), for vLLM, lm-eval or the Hub:

    python -m fgrpo.export RUN_DIR                 # the latest checkpoint, into RUN_DIR/export/step_N
    python -m fgrpo.export RUN_DIR --step 40 --out /models/fgrpo-step40
    python -m fgrpo.export RUN_DIR --merged        # a LoRA run: the merged model instead of its adapter

A LoRA run's checkpoint (``model.lora``) is written as its adapter in PEFT's format (``adapter_config.json``,
``adapter_model.safetensors``, over the base model's folder: ``PeftModel.from_pretrained``, vLLM's LoRA support), or
with ``--merged`` as the merged model; ``fgrpo.evaluate eval.model=FOLDER`` takes either.

Works on a checkpoint saved by any number of ranks, in one process on the CPU (the weights load whole). The model
is rebuilt from the checkpoint's own config (its model source must still be reachable: the bundled model, a
folder, or a hub id on a machine with a network).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from fgrpo.infra.errors import BAD_INPUT
from fgrpo.learner.model_source import export_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fgrpo.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (it holds checkpoints/)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--out", type=Path, default=None, help="the folder to write (default: RUN_DIR/export/step_N)")
    parser.add_argument("--merged", action="store_true",
                        help="a LoRA run: write the merged model (an HF folder) instead of the adapter")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = export_checkpoint(args.run_dir, step=args.step, out=args.out, merged=args.merged)
    except BAD_INPUT as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
