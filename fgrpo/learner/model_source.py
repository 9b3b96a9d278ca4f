"""Where the weights to evaluate or score come from: ``eval.model`` (fgrpo.evaluate) and the model argument of
``fgrpo.rare_nll score`` name a run directory, a checkpoint folder, an HF folder or a hub id; :func:`locate_model`
says which before anything loads, and :func:`model_folder` gives the HF folder to load (a checkpoint is exported to one
first, as ``python -m fgrpo.export`` does)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fgrpo.infra import checkpoint
from fgrpo.infra.errors import CheckpointError, ConfigError
from fgrpo.infra.run_files import CHECKPOINTS, FINAL_MODEL, SAVED_CONFIG
from fgrpo.learner.lora import (apply_lora, is_adapter_folder, lora_settings_of, merge_adapter_folder, sampler_weights,
                                save_adapter)
from fgrpo.learner.model import hub_folder, load_policy, load_tokenizer, resolve_model_folder

# what must match between a trained run and this command's model group: how the prompts are written
PROMPT_KEYS = ("name", "chat_template", "system_prompt", "instruction")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where ``eval.model`` points, found before anything loads."""

    kind: str  # "model group" | "hf folder" | "checkpoint" | "adapter" | "hub"
    location: str | None  # the folder, checkpoint folder or hub id; None for the model group's own weights
    step: int | None  # the training step of the weights, when known
    run_model: dict | None  # the training run's model config, to check the prompt format against


def locate_model(spec: str | None) -> ModelSource:
    """Resolve ``eval.model`` without loading it; raises ConfigError naming what is wrong with it."""
    if spec is None:
        return ModelSource("model group", None, None, None)
    path = Path(spec).expanduser()
    if not path.exists():
        first = Path(spec).parts[0] if Path(spec).parts else ""
        if HUB_ID.match(spec) and not Path(first).is_dir() and not spec.startswith((".", "~", "/")):
            return ModelSource("hub", spec, None, None)
        raise ConfigError(f"eval.model={spec}: no such file or folder. Pass a run directory (outputs/DATE/TIME), a "
                          "checkpoint folder (RUN/checkpoints/step_N), an HF model folder or a hub id (org/name)")
    if not path.is_dir():
        raise ConfigError(f"eval.model={spec} is a file: pass a folder (a run directory, a checkpoint or an HF model)")
    if (path / checkpoint.TRAINER_FILE).is_file():  # RUN/checkpoints/step_N
        if path.parent.name != CHECKPOINTS:
            raise ConfigError(f"eval.model={spec}: a checkpoint is read from its run directory, as "
                              f"RUN/{CHECKPOINTS}/step_N; this one is not in a {CHECKPOINTS}/ folder")
        try:
            state = checkpoint.read_trainer_state(path)
        except Exception as error:  # noqa: BLE001 - any unreadable file: the same answer
            raise ConfigError(f"eval.model={spec}: the checkpoint's {checkpoint.TRAINER_FILE} does not read ({error}); "
                              "pass another checkpoint or the run directory (its newest readable one)") from error
        return ModelSource("checkpoint", str(path), state.step, state.config.get("model"))
    run_config = _saved_run_config(path) or _saved_run_config(path.parent)
    if is_adapter_folder(path):  # a LoRA adapter in PEFT's format (fgrpo.export of a LoRA run): merged before use
        return ModelSource("adapter", str(path), None, None)
    if (path / "config.json").is_file():  # an HF folder: a run's final_model, an export, a download
        step = run_config["trainer"]["steps"] if run_config and path.name == FINAL_MODEL else None
        return ModelSource("hf folder", str(path), step, run_config["model"] if run_config and step is not None else None)
    if (path / FINAL_MODEL / "config.json").is_file():
        return locate_model(str(path / FINAL_MODEL))
    readable = checkpoint.newest_readable(path)
    if readable is not None:
        return locate_model(str(readable[0]))
    if run_config is not None:
        raise ConfigError(f"eval.model={spec} is a run directory with neither {FINAL_MODEL}/ (trainer.save_final) nor a "
                          "checkpoint (trainer.checkpoint_every): nothing to evaluate")
    raise ConfigError(f"eval.model={spec} is neither a run directory, a checkpoint folder nor an HF model folder "
                      "(no config.json, no checkpoints/)")


def _saved_run_config(folder: Path) -> dict | None:
    path = folder / SAVED_CONFIG
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.is_file() else None


def check_prompt_format(source: ModelSource, model_cfg: DictConfig) -> None:
    """A trained run's prompts must be written as it was trained on: the same model group (its name, chat template,
    system prompt and instruction)."""
    if source.run_model is None:
        return
    differing = [f"model.{key}: {source.run_model.get(key)!r} (run) vs {model_cfg.get(key)!r} (now)"
                 for key in PROMPT_KEYS if source.run_model.get(key) != model_cfg.get(key)]
    if differing:
        raise ConfigError(f"eval.model={source.location} was trained with another prompt format:\n  "
                          + "\n  ".join(differing)
                          + f"\nPass the run's model group: model={source.run_model.get('name')} (and its model.* keys)")


def model_folder(source: ModelSource, cfg: DictConfig, out_dir: Path) -> Path:
    """The local HF folder to evaluate: a checkpoint is exported into ``out_dir``/model first."""
    if source.kind == "model group":
        return resolve_model_folder(cfg.model)
    if source.kind == "checkpoint":
        location = Path(source.location)
        return export_checkpoint(location.parent.parent, step=source.step, out=out_dir / "model", merged=True)
    if source.kind == "adapter":
        merge_adapter_folder(source.location, out_dir / "model")
        return out_dir / "model"
    if source.kind == "hub":
        return hub_folder(source.location)
    return Path(source.location)


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


def export_checkpoint(run_dir: Path, *, step: int | None = None, out: Path | None = None,
                      merged: bool = False) -> Path:
    """Write checkpoint ``step`` (default: the latest) of ``run_dir`` as an HF folder; returns the folder. A LoRA run's
    (``model.lora``) is its adapter in PEFT's format over the base model's folder, or with ``merged`` the merged
    model as an HF folder."""
    path = find_checkpoint(run_dir, step)
    state = checkpoint.read_trainer_state(path)
    model_cfg = OmegaConf.create(state.config["model"])
    folder = resolve_model_folder(model_cfg)
    policy = load_policy(folder, dtype=state.config["hardware"]["learner_dtype"], device="cpu", attention="sdpa")
    lora = lora_settings_of(state.config["model"])
    if lora is not None:
        apply_lora(policy, lora)
    checkpoint.load_checkpoint(path, policy)
    out = Path(out) if out is not None else Path(run_dir) / "export" / checkpoint.step_name(state.step)
    if lora is not None and not merged:
        save_adapter(policy, lora, out, folder)
    else:
        policy.save_pretrained(out, state_dict=dict(sampler_weights(policy)) if lora is not None else None)
    load_tokenizer(folder).save_pretrained(out)
    return out
