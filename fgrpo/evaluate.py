"""Evaluate a model on its own, by the paper's protocol: pass@k for k = 1, 2, 4, ..., n from n samples per problem.

    python -m fgrpo.evaluate eval.model=outputs/2026-11-25/10-00-00       # a run: its final_model, else its latest checkpoint
    python -m fgrpo.evaluate eval.model=outputs/2026-11-25/10-00-00/checkpoints/step_40 eval.n_samples=1024
    python -m fgrpo.evaluate model=qwen2_5_7b dataset=deepscaler hardware=gpu eval.n_samples=1024   # a base model

The Hydra groups are run.py's: ``model`` gives the prompt format (and, without ``eval.model``, the weights),
``dataset`` the evaluation sets, ``hardware``, ``sampler`` and ``logger`` the rest; ``eval.n_samples`` (n, up to
1024 and more) and ``eval.max_problems`` the size. ``eval.model`` names the weights: a run directory, a checkpoint
folder, an HF folder or a hub id. It writes into ``outputs/eval/DATE/TIME`` (or ``hydra.run.dir=...``):
``eval_counts.jsonl`` (the per-problem counts that fgrpo.compare reads), ``pass_at_k.md`` (the table with bootstrap
intervals over problems), ``pass_at_k.png``, ``metrics.jsonl``/``summary.json`` and a W&B run as in training.
The draws use the training run's evaluation seed (``seed`` + :data:`fgrpo.train.EVAL_SEED_OFFSET`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from fgrpo.infra import checkpoint  # noqa: E402
from fgrpo.config import to_container, validate  # noqa: E402
from fgrpo.infra.errors import ConfigError

log = logging.getLogger("fgrpo")

FINAL_MODEL = "final_model"
SAVED_CONFIG = Path(".hydra") / "config.yaml"
# what must match between a trained run and this command's model group: how the prompts are written
PROMPT_KEYS = ("name", "chat_template", "system_prompt", "instruction")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where ``eval.model`` points, found before anything loads."""

    kind: str  # "model group" | "hf folder" | "checkpoint" | "hub"
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
        if path.parent.name != checkpoint.CHECKPOINTS:
            raise ConfigError(f"eval.model={spec}: a checkpoint is read from its run directory, as "
                              f"RUN/{checkpoint.CHECKPOINTS}/step_N; this one is not in a {checkpoint.CHECKPOINTS}/ folder")
        try:
            state = checkpoint.read_trainer_state(path)
        except Exception as error:  # noqa: BLE001 - any unreadable file: the same answer
            raise ConfigError(f"eval.model={spec}: the checkpoint's {checkpoint.TRAINER_FILE} does not read ({error}); "
                              "pass another checkpoint or the run directory (its newest readable one)") from error
        return ModelSource("checkpoint", str(path), state.step, state.config.get("model"))
    run_config = _saved_run_config(path) or _saved_run_config(path.parent)
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
    from fgrpo.export import export
    from fgrpo.learner.model import hub_folder, resolve_model_folder

    if source.kind == "model group":
        return resolve_model_folder(cfg.model)
    if source.kind == "checkpoint":
        location = Path(source.location)
        return export(location.parent.parent, step=source.step, out=out_dir / "model")
    if source.kind == "hub":
        return hub_folder(source.location)
    return Path(source.location)


def pass_at_k_markdown(metrics: dict[str, float], dataset_names: list[str], n_samples: int, problems: dict[str, int]) -> str:
    """The markdown table of pass@k with its 95% bootstrap interval (over problems), per set and averaged."""
    from fgrpo.evaluation.pass_at_k import default_ks

    rows = ["| set | problems | n | k | pass@k | 95% interval |", "|---|---:|---:|---:|---:|---|"]
    names = [(name, f"eval/{name}/") for name in dataset_names]
    if len(dataset_names) > 1:
        names.append(("average", "eval/"))
    for label, prefix in names:
        count = problems.get(label, sum(problems.values()))
        for k in default_ks(n_samples):
            key = f"{prefix}pass@{k}"
            rows.append(f"| {label} | {count} | {n_samples} | {k} | {metrics[key]:.4f} | "
                        f"[{metrics[key + '_ci_low']:.4f}, {metrics[key + '_ci_high']:.4f}] |")
    return "\n".join(rows) + "\n"


def evaluate_model(cfg: DictConfig, out_dir: Path, *, run_name: str | None = None, overrides: list[str] | None = None,
                   saved_config: Path | None = None) -> dict[str, float]:
    """Evaluate the model ``cfg.eval.model`` names (see the module's docstring); returns the pass@k metrics."""
    from fgrpo.evaluation.held_out import COUNTS_FILE, append_counts, evaluate
    from fgrpo.learner.model import load_policy
    from fgrpo.evaluation.plots import plot_pass_at_k
    from fgrpo.rollout.samplers import require_vllm
    from fgrpo.train import EVAL_SEED_OFFSET, _encode_prompts, load_data, make_sampler, make_tracker, settle_hardware
    from fgrpo.rollout.verifier import close_verifier, make_verifier

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("fgrpo.evaluate runs in one process: start it with python, not torchrun or srun -n >1")
    validate(cfg)
    source = locate_model(cfg.eval.model)  # before anything loads: a wrong path fails at once
    check_prompt_format(source, cfg.model)
    data = load_data(cfg.dataset)
    verifier = make_verifier(cfg.dataset.verifier, timeout_s=cfg.dataset.verifier_timeout_s,
                             workers=cfg.dataset.verifier_workers)
    if cfg.sampler.name == "vllm":
        require_vllm()
    if (out_dir / COUNTS_FILE).exists():
        raise ConfigError(f"{out_dir} already holds an evaluation ({COUNTS_FILE}): pass another hydra.run.dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = model_folder(source, cfg, out_dir)
    precision = settle_hardware(cfg, saved_config)
    tokenizer, prompt_ids = _encode_prompts(cfg, folder, data)
    hw = cfg.hardware
    # the learner's attention kernel: the HF sampler of a training run generates with it
    policy = (load_policy(folder, dtype=hw.learner_dtype, device=hw.device, attention=hw.attention).eval()
              if cfg.sampler.name == "hf" else None)
    log.info("evaluating %s (%s%s): %s x %d samples", source.location or f"model={cfg.model.name}", source.kind,
             f", step {source.step}" if source.step is not None else "",
             ", ".join(f"{name} {min(len(p), cfg.eval.max_problems)} problems" for name, p in data.eval.items()),
             cfg.eval.n_samples)
    sampler = make_sampler(cfg, folder, policy, tokenizer)
    try:
        with make_tracker(cfg, out_dir, run_name, overrides, precision) as tracker:
            metrics, curve, count_rows = evaluate(
                sampler, data.eval, prompt_ids, verifier, n_samples=cfg.eval.n_samples,
                max_problems=cfg.eval.max_problems, max_new_tokens=cfg.sampler.max_new_tokens,
                temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p, seed=cfg.seed + EVAL_SEED_OFFSET)
            append_counts(out_dir, source.step, count_rows)
            problems = {name: min(len(p), cfg.eval.max_problems) for name, p in data.eval.items()}
            (out_dir / "pass_at_k.md").write_text(pass_at_k_markdown(metrics, list(data.eval), cfg.eval.n_samples, problems))
            label = f"{Path(source.location).name if source.location else cfg.model.name}"
            plot_pass_at_k({label: curve}, out_dir / "pass_at_k.png",
                           title=f"{label} | {cfg.dataset.name} | n={cfg.eval.n_samples}")
            tracker.log(metrics, step=source.step or 0)
            tracker.log_image("eval/pass_at_k_curve", out_dir / "pass_at_k.png", step=source.step or 0)
            final = {k: v for k, v in metrics.items() if not k.endswith(("_ci_low", "_ci_high"))}
            tracker.summary({**final, "eval/model": source.location or cfg.model.name, "eval/model_kind": source.kind,
                             "eval/model_step": source.step})
    finally:
        close_verifier(verifier)
        sampler.close()
    return final


def _default_run_dir(argv: list[str]) -> None:
    """Evaluations go under outputs/eval/ unless the command names a directory."""
    if not any(arg.startswith("hydra.run.dir=") for arg in argv):
        argv.append("hydra.run.dir=outputs/eval/${now:%Y-%m-%d}/${now:%H-%M-%S}")


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from fgrpo.config import register_configs
    from fgrpo.infra.errors import DataError
    from fgrpo.infra.errors import ModelSourceError
    from fgrpo.infra.errors import SamplerUnavailable

    register_configs()
    _default_run_dir(sys.argv)

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def app(cfg: DictConfig) -> None:
        hydra_cfg = HydraConfig.get()
        out_dir = Path(hydra_cfg.runtime.output_dir)
        saved = out_dir / hydra_cfg.output_subdir / "config.yaml" if hydra_cfg.output_subdir else None
        log.info("evaluation directory: %s", out_dir)
        try:
            final = evaluate_model(cfg, out_dir, run_name=f"eval-{hydra_cfg.job.override_dirname or 'default'}",
                                   overrides=list(hydra_cfg.overrides.task), saved_config=saved)
        except (ConfigError, DataError, ModelSourceError, SamplerUnavailable, CheckpointError) as error:
            log.error("%s", error)
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        print(f"pass@k of {to_container(cfg)['eval']['model'] or cfg.model.name} written to {out_dir}")
        print((out_dir / "pass_at_k.md").read_text(), end="")
        log.info("final: %s", {k: round(v, 4) for k, v in final.items() if k.count("/") == 1})

    app()


if __name__ == "__main__":
    main()
