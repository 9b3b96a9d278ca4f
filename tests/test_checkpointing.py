"""fgrpo.checkpointing: which checkpoint a run resumes from, and what may change when it does (the experiment may
not: config.experiment_differences). Saving and loading the files: tests/infra/test_checkpoint.py; whole runs that
stop and resume: tests/test_resume.py."""

import json

from checkpoint_saves import model_and_optimizer
from fgrpo.checkpointing import plan_resume
from fgrpo.config import experiment_differences, to_container
from fgrpo.infra import checkpoint


def state(step: int, **extra) -> checkpoint.TrainerState:
    return checkpoint.TrainerState(step=step, stream={"epoch": 1, "cursor": 3 * step}, scheduler={"last_epoch": step},
                                   **extra)


def test_only_changes_to_the_experiment_block_a_resume():
    saved = {"focal": {"gamma": 1.0}, "algo": {"name": "grpo", "group_size": 8}, "trainer": {"lr": 1e-6, "steps": 100},
             "hardware": {"micro_batch_size": 4, "learner_dtype": "float32"}, "logger": {"name": "wandb"}, "seed": 0}
    same_experiment = json.loads(json.dumps(saved))
    same_experiment["trainer"]["steps"] = 300  # extending a run
    same_experiment["hardware"]["micro_batch_size"] = 8  # another machine, other ranks
    same_experiment["logger"]["name"] = "none"
    assert experiment_differences(saved, same_experiment) == []
    other = json.loads(json.dumps(saved))
    other["focal"]["gamma"], other["trainer"]["lr"], other["hardware"]["learner_dtype"] = 0.5, 1e-5, "bfloat16"
    other["algo"]["new_option"] = True  # a key a later fgrpo added: the saved run ran its default
    del other["seed"]  # a key that went away
    assert experiment_differences(saved, other) == [
        "focal.gamma: 1.0 -> 0.5", "hardware.learner_dtype: 'float32' -> 'bfloat16'", "seed: 0 -> '<absent>'",
        "trainer.lr: 1e-06 -> 1e-05"]


def test_resume_false_holds_for_the_first_attempt_only(compose, tmp_path, monkeypatch):
    """A requeued Slurm job (or a restarted torchrun) repeats the first attempt's command: trainer.resume=false
    must not throw away what the attempts before saved."""
    cfg = compose("trainer.resume=false", "trainer.lr=3e-5")  # a run's checkpoint holds the lr it resolved
    model, optimizer = model_and_optimizer(hidden=16)
    checkpoint.save_checkpoint(tmp_path, model, optimizer, state(2, config=to_container(cfg)), keep=2)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert plan_resume(cfg, tmp_path) is True and not list(tmp_path.glob("replaced-*"))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert plan_resume(cfg, tmp_path) is False and list(tmp_path.glob("replaced-*/checkpoints/step_0000002"))
