"""Checkpoints (fgrpo/infra/checkpoint.py): bitwise round trips, the ``latest`` pointer and pruning, falling back past a
partial or corrupt checkpoint, a kill during a save, a full disk. The resume rules: tests/test_checkpointing.py; whole
runs that resume: tests/test_resume.py."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint_saves import model_and_optimizer
from ci_strict import skip_unless_ci
from fgrpo.infra import checkpoint
from fgrpo.infra.errors import CheckpointError

CHILDREN = Path(__file__).resolve().parents[1] / "children"


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    return model, optimizer


def train_once(model, optimizer, seed: int) -> None:
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def state(step: int, **extra) -> checkpoint.TrainerState:
    return checkpoint.TrainerState(step=step, stream={"epoch": 1, "cursor": 3 * step}, scheduler={"last_epoch": step},
                                   **extra)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [value for per_param in optimizer.state.values() for value in per_param.values()]


def test_a_checkpoint_restores_weights_moments_and_random_states_bitwise(tmp_path):
    model, optimizer = tiny_llama(seed=0)
    train_once(model, optimizer, seed=1)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    checkpoint.save_checkpoint(tmp_path, model, optimizer, state(1, wandb_run_id="abc", before={"eval/pass@1": 0.25},
                                                                   config={"focal": {"gamma": 1.0}}), keep=2)
    draws = (random.random(), np.random.rand(), torch.rand(2))
    train_once(model, optimizer, seed=2)  # what the run did after the save: the resumed one must redo it exactly
    continued = [p.detach().clone() for p in model.parameters()]

    other, other_optimizer = tiny_llama(seed=9)  # other weights, no moments yet
    resumed = checkpoint.resume(tmp_path, other, other_optimizer)
    assert resumed.path.name == "step_0000001" and resumed.state.step == 1
    assert resumed.state.wandb_run_id == "abc" and resumed.state.before == {"eval/pass@1": 0.25}
    assert resumed.state.stream == {"epoch": 1, "cursor": 3} and resumed.state.config == {"focal": {"gamma": 1.0}}
    checkpoint.restore_rng(resumed.rng)
    assert random.random() == draws[0] and np.random.rand() == draws[1] and torch.equal(torch.rand(2), draws[2])
    # the tied lm_head is the embedding after loading too
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()
    train_once(other, other_optimizer, seed=2)
    for mine, theirs in zip(continued, other.parameters()):
        assert torch.equal(mine, theirs)
    assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(optimizer), optimizer_tensors(other_optimizer)))


def test_latest_names_the_newest_and_only_the_newest_k_are_kept(tmp_path):
    model, optimizer = model_and_optimizer(hidden=16)
    for step in (2, 4, 6):
        checkpoint.save_checkpoint(tmp_path, model, optimizer, state(step), keep=2)
    root = checkpoint.checkpoints_dir(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000004", "step_0000006"]
    assert (root / "latest").read_text() == "step_0000006"
    assert [p.name for p in checkpoint.resume_candidates(tmp_path)] == ["step_0000006", "step_0000004"]


def test_a_partial_save_and_a_latest_naming_a_missing_checkpoint_are_passed_over(tmp_path, caplog):
    model, optimizer = model_and_optimizer(hidden=16)
    for step in (1, 2):
        checkpoint.save_checkpoint(tmp_path, model, optimizer, state(step), keep=3)
    root = checkpoint.checkpoints_dir(tmp_path)
    shutil.copytree(root / "step_0000002", root / ".step_0000003.partial")  # a kill before the rename
    (root / ".step_0000003.partial" / checkpoint.TRAINER_FILE).unlink()
    assert [p.name for p in checkpoint.resume_candidates(tmp_path)] == ["step_0000002", "step_0000001"]
    shutil.rmtree(root / "step_0000002")  # latest now names a checkpoint that is gone
    assert [p.name for p in checkpoint.resume_candidates(tmp_path)] == ["step_0000001"]
    assert "step_0000002 is incomplete or missing" in caplog.text
    checkpoint.save_checkpoint(tmp_path, model, optimizer, state(4), keep=3)  # the next save clears the partial one
    assert not list(root.glob(".*partial"))


def test_a_corrupt_checkpoint_falls_back_to_the_one_before_and_none_readable_is_a_clear_error(tmp_path, caplog):
    model, optimizer = model_and_optimizer(hidden=16)
    for step in (1, 2):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(step)
        checkpoint.save_checkpoint(tmp_path, model, optimizer, state(step), keep=2)
    root = checkpoint.checkpoints_dir(tmp_path)
    for data in (root / "step_0000002" / checkpoint.WEIGHTS).glob("*.distcp"):
        data.write_bytes(b"not a checkpoint")
    fresh, fresh_optimizer = model_and_optimizer(hidden=16)
    resumed = checkpoint.resume(tmp_path, fresh, fresh_optimizer)
    assert resumed.state.step == 1 and all(torch.all(p == 1) for p in fresh.parameters())
    assert "step_0000002 could not be loaded" in caplog.text
    for data in (root / "step_0000001" / checkpoint.WEIGHTS).glob("*.distcp"):
        data.write_bytes(b"not a checkpoint either")
    with pytest.raises(CheckpointError, match="(?s)no checkpoint in .* could be loaded.*EOFError.*trainer.resume=false"):
        checkpoint.resume(tmp_path, fresh, fresh_optimizer)


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_current(tmp_path):
    """SIGKILL at random moments of a process that does nothing but save: whatever it cut, the latest checkpoint
    loads whole (every parameter holds its step's number)."""
    rng = random.Random(0)
    cut_partial = 0
    for attempt in range(4):
        run_dir = tmp_path / str(attempt)
        process = subprocess.Popen([sys.executable, str(CHILDREN / "checkpoint_saves.py"), "loop", str(run_dir)],
                                   stdout=subprocess.PIPE, text=True)
        saved = [int(process.stdout.readline()) for _ in range(3)]
        time.sleep(rng.uniform(0, 0.3))
        process.send_signal(signal.SIGKILL)
        process.wait()
        saved += [int(line) for line in process.stdout.read().split()]
        process.stdout.close()
        cut_partial += bool(list(checkpoint.checkpoints_dir(run_dir).glob(".*partial")))
        model, optimizer = model_and_optimizer()
        resumed = checkpoint.resume(run_dir, model, optimizer)
        assert resumed.state.step in (saved[-1], saved[-1] + 1)  # +1: killed after the rename, before the print
        assert all(torch.all(p == resumed.state.step) for p in model.parameters())
    assert cut_partial, "no kill landed inside a save: the test proved nothing"


def _in_private_mount(command: list[str]) -> list[str] | None:
    """``command`` in a mount namespace of its own (root: unshare -m; others: a user namespace), or None."""
    if shutil.which("unshare") is None:
        return None
    flags = "-m" if os.geteuid() == 0 else "-rm"
    probe = subprocess.run(["unshare", flags, "true"], capture_output=True)
    return ["unshare", flags, *command] if probe.returncode == 0 else None


def test_a_full_disk_is_a_clear_error_that_keeps_the_previous_checkpoint_and_the_metrics(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = (f"mount -t tmpfs -o size=8m tmpfs {run_dir} && "
              f"{sys.executable} {CHILDREN / 'checkpoint_saves.py'} fill {run_dir}")
    command = _in_private_mount(["sh", "-c", script])
    if command is None:  # under CI=true a failure
        skip_unless_ci("needs a tmpfs of its own (unshare -m as root, or user namespaces) to fill a disk for real")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert "checkpoint of step 2: the disk under" in verdict["error"] and "is full" in verdict["error"]
    assert "the previous one (step_0000001) is kept" in verdict["error"]
    assert verdict["complete"] == ["step_0000001"] and verdict["partial"] == []
    # every row whole, in order, the one after the failure included
    assert [(row["step"], row["train/loss"]) for row in verdict["rows"]] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_a_checkpoint_whose_trainer_state_does_not_read_is_passed_over(tmp_path, caplog):
    model, optimizer = model_and_optimizer(hidden=16)
    for step in (1, 2):
        checkpoint.save_checkpoint(tmp_path, model, optimizer, state(step), keep=2)
    (checkpoint.checkpoints_dir(tmp_path) / "step_0000002" / checkpoint.TRAINER_FILE).write_bytes(b"")  # a dead node
    path, found = checkpoint.newest_readable(tmp_path)
    assert path.name == "step_0000001" and found.step == 1
    assert "step_0000002: its trainer.pt does not read" in caplog.text
    resumed = checkpoint.resume(tmp_path, *model_and_optimizer(hidden=16))
    assert resumed.state.step == 1


def test_a_save_after_falling_back_removes_the_abandoned_later_checkpoints_not_itself(tmp_path):
    model, optimizer = model_and_optimizer(hidden=16)
    for step in (2, 4, 6):
        checkpoint.save_checkpoint(tmp_path, model, optimizer, state(step), keep=3)
    root = checkpoint.checkpoints_dir(tmp_path)
    (root / "latest").write_text("step_0000002")  # a resume from step 2 (4 and 6 passed over)
    checkpoint.save_checkpoint(tmp_path, model, optimizer, state(3), keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000003"]
    assert (root / "latest").read_text() == "step_0000003"
