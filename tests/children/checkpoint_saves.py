"""Checkpoint saves for tests/infra/test_checkpoint.py to kill or starve, in a process of their own.

    python tests/children/checkpoint_saves.py loop RUN_DIR   # save steps 1, 2, 3 ... until killed; prints each saved step
    python tests/children/checkpoint_saves.py fill RUN_DIR   # save step 1, fill the disk, try step 2: prints a JSON verdict

Every parameter of the saved model holds its step's number, so a loaded checkpoint shows which step it is and
whether it is whole.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fgrpo.infra import checkpoint  # noqa: E402
from fgrpo.infra.errors import CheckpointError  # noqa: E402
from fgrpo.infra.tracking import Tracker  # noqa: E402
from fgrpo.infra.run_files import read_metrics


def model_and_optimizer(hidden: int = 256):
    """A model of some megabytes (a save takes long enough to be cut), with AdamW moments after one step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, hidden), torch.nn.Linear(hidden, hidden),
                                torch.nn.Linear(hidden, 4096))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    return model, optimizer


def state_of(step: int) -> checkpoint.TrainerState:
    return checkpoint.TrainerState(step=step, stream={"epoch": 0, "cursor": step}, scheduler={})


def mark(model, step: int) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(step)


def loop(run_dir: Path) -> None:
    model, optimizer = model_and_optimizer()
    step = 0
    while True:
        step += 1
        mark(model, step)
        checkpoint.save_checkpoint(run_dir, model, optimizer, state_of(step), keep=2)
        print(step, flush=True)


def fill(run_dir: Path) -> None:
    model, optimizer = model_and_optimizer(hidden=64)
    with Tracker(run_dir, backend="none") as tracker:
        mark(model, 1)
        tracker.log({"train/loss": 1.0}, step=1)
        checkpoint.save_checkpoint(run_dir, model, optimizer, state_of(1), keep=2)
        tracker.log({"train/loss": 2.0}, step=2)
        filler = run_dir / "filler"
        with open(filler, "wb") as file:  # the disk's last bytes
            try:
                while True:
                    file.write(b"\0" * 65536)
                    file.flush()
            except OSError:
                pass
        mark(model, 2)
        try:
            checkpoint.save_checkpoint(run_dir, model, optimizer, state_of(2), keep=2)
            error = None
        except CheckpointError as failure:
            error = str(failure)
        filler.unlink()  # room again: the run could go on, and the metrics file must still be whole
        tracker.log({"train/loss": 3.0}, step=3)
    partial = [p.name for p in checkpoint.checkpoints_dir(run_dir).glob(".*partial")]
    print(json.dumps({"error": error, "partial": partial, "rows": read_metrics(run_dir / "metrics.jsonl"),
                      "complete": [p.name for p in checkpoint.complete_checkpoints(run_dir)]}))


if __name__ == "__main__":
    {"loop": loop, "fill": fill}[sys.argv[1]](Path(sys.argv[2]))
